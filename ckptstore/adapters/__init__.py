"""The trainer adapters: a trainer's checkpoint directory, Hugging Face and Lightning.

``directory`` publishes a trainer's checkpoint directory as one checkpoint and materialises it
back, ``localdir`` is what ``materialize`` makes beside its target (the lock, the marker of a
pulled directory, the recovery of an interrupted swap), ``huggingface`` the ``Trainer``
callback, ``lightning`` the ``CheckpointIO`` plugin. Each is imported on its own (the trainers
are optional dependencies); ``ckptstore.directory``, ``ckptstore.huggingface`` and
``ckptstore.lightning`` are the same modules under their shorter names. The PyTorch adapter is
``ckptstore.torch``.
"""
