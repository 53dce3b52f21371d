"""orbax's CheckpointManager surface on jaxckpt: the one place that reads orbax's types.

``_options`` turns orbax's ``CheckpointManagerOptions`` into jaxckpt's options and the
manager's rules (which steps are saved and kept), ``_items`` and ``_targets`` its
``args=`` forms into one tree and a restore target, and ``_verbs`` holds orbax's verbs
and the kept steps, mixed into :class:`jaxckpt.CheckpointManager`. The manager itself
never sees an orbax type.
"""
