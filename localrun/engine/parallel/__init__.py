"""Tensor parallelism: a rank's shard of the model and the processes of a group.

group.py (TPGroup: shard shapes, collectives, the step message) is used by the models and
the runner; launch.py (spawning the follower ranks) is used by the engine, which hands it
the function each follower builds its engine with.
"""
