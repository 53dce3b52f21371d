"""orbax's CheckpointManager surface on jaxckpt: its ``args=`` forms as one tree (``_items``)."""
