"""Tiers: a fast store and a durable one as one store, and the replicator between them.

``tiered`` is the pair (``TieredStore``, the tiered URL form ``?replicate_to=``), and
``replication`` the replicator and its policies. ``ckptstore.tiered`` and
``ckptstore.replication`` are the same modules under their shorter names.
"""
