"""Algorithms as flows of stages on a cluster, registered by name (`registry`)."""
