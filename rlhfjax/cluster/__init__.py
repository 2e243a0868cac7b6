"""Roles on their meshes: weights, optimizer states, compiled programs and the one mover."""
