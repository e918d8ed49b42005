"""Strategies for the optimizers of :mod:`fused_optim.distributed`, by name (registered when
``lightning_optim`` is imported):

* ``"centralized"``, ``"decentralized"`` (popen launcher, like ``"ddp"``) and their ``"_spawn"``
  variants: :class:`OptimizerSyncedStrategy`, processes and a process group as DDP's, the model
  *not* wrapped in ``DistributedDataParallel``: the optimizer communicates.
* ``"powersgd_ddp"``, ``"powersgd_ddp_spawn"``: :class:`PowerSGDDDPStrategy`, DDP with torch's
  ``powerSGD_hook`` (on every device; Lightning's own ``ddp_comm_hook`` is CUDA-only).
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from typing_extensions import override

from fused_optim.distributed import check_communicates, per_rank

from ._compat import sync_module_states
from .powersgd_state import PowerSGDKeeper
from .strategy import GroupEndingDDPStrategy

RANK_KEYS = ("state_dict", "optimizer_states")  # what differs between ranks


class OptimizerSyncedStrategy(GroupEndingDDPStrategy):
    """DDP's processes, process group and ``DistributedSampler`` (each rank its own shard), but
    the model is not wrapped in ``DistributedDataParallel``: the optimizer communicates
    (:mod:`fused_optim.distributed`). At setup rank 0's params and buffers are broadcast, so every
    rank starts from the same model; afterwards buffers (BatchNorm statistics) stay per rank.
    Gradient accumulation needs no ``no_sync``: nothing communicates before ``optimizer.step``.

    Checkpoints are per rank: the ranks' params may differ (``DecentralizedSGD``) and so may their
    optimizer state (``PowerSGD``'s error memories, ``CentralizedSparsifiedSGD``'s memory), so rank 0
    gathers every rank's ``state_dict`` and ``optimizer_states`` into ``checkpoint["per_rank"]``
    (the top-level entries stay rank 0's, for loading into one process) and, on resume, each rank
    loads its own, after the broadcast. A resume needs the same number of ranks.

    ``"centralized"`` and ``"decentralized"`` are both this class: Lightning's side is the same for
    all the optimizers (which ranks exchange what is the optimizer's business); the two names say
    which kind of optimizer the module's ``configure_optimizers`` returns.

    Args: ``DDPStrategy``'s, without the ``DistributedDataParallel`` and comm-hook options.

    Example::

        import lightning.pytorch as pl, lightning_optim
        import fused_optim.distributed as fd
        # in the LightningModule: def configure_optimizers(self): return fd.CentralizedSGD(None, self, lr=0.1)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="centralized", max_steps=100)
    """

    def __init__(self, accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None, process_group_backend: str | None = None, timeout=None,
                 start_method: str = "popen"):
        extra = {} if timeout is None else {"timeout": timeout}
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         start_method=start_method, **extra)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # after configure_ddp's broadcast, which would overwrite the other ranks' params

    @override
    def setup_optimizers(self, trainer) -> None:
        """``DDPStrategy``'s, then refuses an optimizer that does not communicate: without a DDP
        wrapper, each rank would train its own model and nothing would say so."""
        super().setup_optimizers(trainer)
        for opt in self.optimizers:
            check_communicates(opt, "strategy 'centralized' / 'decentralized'", "strategy='ddp'")

    @override
    def configure_ddp(self) -> None:
        sync_module_states(self.model)  # rank 0's params and buffers to every rank; no wrapper

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        gathered = per_rank.gather(checkpoint, RANK_KEYS)
        if self.is_global_zero:
            super().save_checkpoint({**checkpoint, per_rank.PER_RANK: gathered}, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        return per_rank.restore(super().load_checkpoint(checkpoint_path, weights_only), str(checkpoint_path),
                                "devices × num_nodes")

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        for kind in ("centralized", "decentralized"):
            for name, start_method in ((kind, "popen"), (f"{kind}_spawn", "spawn")):
                strategy_registry.register(name, cls, description=f"{kind} fused_optim.distributed optimizer, "
                                           f"no DDP wrapper, start_method '{start_method}'",
                                           start_method=start_method, override=True)


POWERSGD_OPTIONS = [name for name in inspect.signature(PowerSGDState).parameters if name != "process_group"]


HOOK_KEY = "powersgd_hook_state"  # a per-rank checkpoint entry of PowerSGDDDPStrategy


class PowerSGDDDPStrategy(GroupEndingDDPStrategy):
    """``DDPStrategy`` whose ``DistributedDataParallel`` averages grads through torch's
    ``powerSGD_hook`` (Vogels et al., 2019: rank-r compression with error feedback), on CPU too.

    Args:
        matrix_approximation_rank, start_powerSGD_iter, min_compression_rate, use_error_feedback,
            warm_start, orthogonalization_epsilon, random_seed, compression_stats_logging_frequency,
            batch_tensors_with_same_shape: ``PowerSGDState``'s options (torch's defaults).
        **kwargs: ``DDPStrategy``'s, without ``ddp_comm_state`` / ``ddp_comm_hook``.

    Checkpoints hold every rank's hook state (:class:`.powersgd_state.PowerSGDKeeper`: error
    memories and warm-start Q per param, counters, generator), gathered into
    ``checkpoint["per_rank"]`` (the model and optimizer are DDP's, the same on every rank); on
    resume each rank's is put back into the hook, whatever DDP's bucket layout, so the run
    continues exactly. A resume needs the same number of ranks.

    Example::

        trainer = pl.Trainer(devices=2, strategy="powersgd_ddp")
        StrategyRegistry.register("powersgd_r4", lightning_optim.PowerSGDDDPStrategy,
                                  matrix_approximation_rank=4, start_powerSGD_iter=10)
    """

    def __init__(self, *args: Any, **kwargs: Any):
        for name in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"):
            if name in kwargs:
                raise ValueError(f"PowerSGDDDPStrategy registers powerSGD_hook itself: drop {name}= (or use "
                                 "DDPStrategy for another hook)")
        self.powersgd_options = {name: kwargs.pop(name) for name in POWERSGD_OPTIONS if name in kwargs}
        super().__init__(*args, **kwargs)
        self.powersgd_state: PowerSGDState | None = None
        self.powersgd_keeper: PowerSGDKeeper | None = None
        self._resumed_hook_state: dict | None = None  # loaded before the hook exists: put in at registration

    @override
    def configure_ddp(self) -> None:
        """``DDPStrategy``'s wrapper, then torch's ``powerSGD_hook`` (through :class:`PowerSGDKeeper`)
        registered on it, with a hook state restored from a checkpoint if one came first."""
        super().configure_ddp()
        self.powersgd_state = PowerSGDState(process_group=None, **self.powersgd_options)
        self.powersgd_keeper = PowerSGDKeeper(self.powersgd_state, list(self.model.module.parameters()))
        self.model.register_comm_hook(self.powersgd_state, self.powersgd_keeper.hook)
        if self._resumed_hook_state is not None:
            self.powersgd_keeper.load_state_dict(self._resumed_hook_state, self.root_device)
            self._resumed_hook_state = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        own = {} if self.powersgd_keeper is None else {HOOK_KEY: self.powersgd_keeper.state_dict()}
        gathered = per_rank.gather(own, (HOOK_KEY,))
        if self.is_global_zero:
            super().save_checkpoint({**checkpoint, per_rank.PER_RANK: gathered}, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = per_rank.restore(super().load_checkpoint(checkpoint_path, weights_only), str(checkpoint_path),
                                      "devices × num_nodes")
        saved = checkpoint.pop(HOOK_KEY, None)
        if saved is not None and self.powersgd_keeper is not None:
            self.powersgd_keeper.load_state_dict(saved, self.root_device)
        elif saved is not None:
            self._resumed_hook_state = saved
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in (("powersgd_ddp", "popen"), ("powersgd_ddp_spawn", "spawn")):
            strategy_registry.register(name, cls, description=f"DDP + torch's powerSGD_hook, start_method "
                                       f"'{start_method}'", start_method=start_method, override=True)


OptimizerSyncedStrategy.register_strategies(StrategyRegistry)
PowerSGDDDPStrategy.register_strategies(StrategyRegistry)
