"""JAX integration (``pip install 'ckptstore[jax]'``): pytrees of sharded arrays to a
checkpoint and back onto any sharding, with every guarantee a PyTorch trainer gets.

    from ckptstore.jax import AsyncPytreeSaver, load_pytree, save_pytree

    save_pytree(store, step, {"params": params, "opt_state": opt_state, "step": step})
    state = load_pytree(store, target)   # target: arrays or jax.ShapeDtypeStruct + sharding

Arrays are stored as safetensors parts (each addressable shard written once, by the process
that owns its first replica), the tree as JSON; nothing is pickled. A load reads, with
checked ranged reads, only the boxes its devices need, onto the target's mesh whatever the
save's was. Several processes (``jax.distributed``) publish one checkpoint through
``ckptstore.coordinated`` and load the one step their coordinator chose.
"""

from ckptstore.jax.async_save import AsyncPytreeSaver
from ckptstore.jax.reads import ReadStats
from ckptstore.jax.restore import load_pytree
from ckptstore.jax.save import save_pytree, snapshot_pytree

__all__ = ["AsyncPytreeSaver", "ReadStats", "load_pytree", "save_pytree", "snapshot_pytree"]
