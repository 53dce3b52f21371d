"""orbax's CheckpointManager surface on jaxckpt: the one place that reads orbax's types.

``_options`` turns orbax's ``CheckpointManagerOptions`` into jaxckpt's options (its
policies carried whole) and the directory's rules, ``_policies`` builds orbax's
save-decision and preservation policies into jaxckpt's one policy shape, ``_items``
and ``_targets`` turn its ``args=`` forms into one tree and a restore target,
``_root`` keeps its root metadata and ``_errors`` its errors. The façade
:class:`jaxckpt.CheckpointManager` calls them at its edge; the manager's core
(:mod:`jaxckpt.core`) never sees an orbax type.
"""
