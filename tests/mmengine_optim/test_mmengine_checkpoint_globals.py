"""The globals mmengine writes into a checkpoint are exactly the ones importing mmengine_optim allows
in ``torch.load(weights_only=True)``, and its ``getattr`` reaches a HistoryBuffer statistics method only."""

import io
import os

import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer, MessageHub

import mmengine_optim  # noqa: F401  (registers the globals)
from mmengine_optim.checkpoint_globals import CHECKPOINT_GLOBALS, history_buffer_method

def message_hub_checkpoint() -> bytes:
    """What mmengine's CheckpointHook writes for the message hub (``message_hub.state_dict()``):
    logged scalars (HistoryBuffers) and runtime info with a numpy scalar (IterTimerHook's ETA)."""
    hub = MessageHub.get_instance("checkpoint_globals_test")
    for i in range(3):
        hub.update_scalar("train/loss", 1.0 / (i + 1))
        hub.update_scalar("train/lr", 0.1, count=2)
    hub.update_info("eta", np.float64(12.5))
    hub.update_info("iter", 3)
    buffer = io.BytesIO()
    torch.save({"message_hub": hub.state_dict()}, buffer)
    return buffer.getvalue()


def written_globals(path) -> set[str]:
    """The globals in the checkpoint beyond torch's own allowlist (torch's function leaves out the
    registered ones: they are cleared while it reads, then restored)."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        return set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    finally:
        torch.serialization.add_safe_globals(registered)


def test_the_allowed_globals_are_listed():
    """The names numpy 2 pickles under (numpy 1.x: numpy.core.multiarray, and no dtype classes)."""
    assert sorted(name for _, name in CHECKPOINT_GLOBALS) == sorted([
        "mmengine.logging.history_buffer.HistoryBuffer", "numpy.ndarray", "numpy.dtype",
        "numpy._core.multiarray._reconstruct", "numpy._core.multiarray.scalar", "numpy.dtypes.Float64DType",
        "numpy.dtypes.Int64DType", "builtins.getattr"])


def test_what_mmengine_writes_is_what_is_allowed_and_loads(tmp_path):
    assert os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD") is None
    path = tmp_path / "hub.pth"
    path.write_bytes(message_hub_checkpoint())
    # the dtypes' classes are not named in the pickle, but their state is set (BUILD), which needs them
    built = {"numpy.dtypes.Float64DType", "numpy.dtypes.Int64DType"}
    assert written_globals(path) == {name for _, name in CHECKPOINT_GLOBALS} - built
    hub = torch.load(path)["message_hub"]  # torch's default weights_only=True
    loss = hub["log_scalars"]["train/loss"]
    assert isinstance(loss, HistoryBuffer) and loss.mean() == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)
    assert hub["log_scalars"]["train/lr"].data[1].tolist() == [2, 2, 2]
    assert hub["runtime_info"]["eta"] == 12.5 and hub["runtime_info"]["iter"] == 3


class _Reach:
    """Pickles as ``getattr(owner, name)``: how a checkpoint would reach other attributes."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


@pytest.mark.parametrize("owner, name", [(HistoryBuffer, "_set_default_statistics"), (HistoryBuffer, "__init__"),
                                         (np.ndarray, "tofile"), (HistoryBuffer, "statistics_typo")])
def test_getattr_in_a_checkpoint_reaches_only_statistics_methods(owner, name):
    buffer = io.BytesIO()
    torch.save({"x": _Reach(owner, name)}, buffer)
    buffer.seek(0)
    with pytest.raises(Exception, match="only for a HistoryBuffer statistics method"):
        torch.load(buffer)


def test_getattr_resolves_the_statistics_methods():
    assert [history_buffer_method(HistoryBuffer, m) for m in ("min", "max", "current", "mean")] == [
        HistoryBuffer.min, HistoryBuffer.max, HistoryBuffer.current, HistoryBuffer.mean]
