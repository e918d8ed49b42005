"""Bare optimizer and wrapper names in mmengine configs, as a user writes them: with
``mmengine_optim`` imported (or in ``custom_imports``) ColossalAI's and apex's names and every
registered optimizer build ours, unless mmengine owns the name; then, and for a typo, the error
says what to write."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from mmengine.optim import build_optim_wrapper

import fused_optim
import mmengine_optim
from fused_optim.registry import CLASS_ALIASES, get_spec, list_optimizers

SEEDS = ("FusedAdam", "FusedSGD", "FusedLAMB", "CPUAdam", "HybridAdam", "Lamb", "Lars")
MMENGINE_OWNS = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW,
                 "Adagrad": torch.optim.Adagrad}  # torch.optim's


def expected_class(name: str) -> type:
    if name in CLASS_ALIASES:
        return CLASS_ALIASES[name]
    if name in list_optimizers():
        return get_spec(name).cls
    return getattr(fused_optim, name)


def build(optimizer_type: str, wrapper_type: str = "OptimWrapper"):
    model = torch.nn.Linear(3, 2)
    return build_optim_wrapper(model, dict(type=wrapper_type, optimizer=dict(type=optimizer_type, lr=0.01)))


NAMES = sorted(set(SEEDS) | set(list_optimizers()) | {get_spec(n).cls.__name__ for n in list_optimizers()}
               | set(CLASS_ALIASES))


@pytest.mark.parametrize("name", NAMES)
def test_every_seed_and_registered_name_builds_bare(name):
    built = type(build(name).optimizer)
    assert built is MMENGINE_OWNS.get(name, expected_class(name))


def test_seed_names_are_all_registered():
    assert set(SEEDS) <= set(mmengine_optim.OPTIMIZERS.module_dict)


@pytest.mark.parametrize("typo, suggestion", [("FusedAdm", "'FusedAdam'"), ("fusedlamb", "'FusedLAMB'")])
def test_a_typo_names_itself_and_the_close_names(typo, suggestion):
    with pytest.raises(KeyError) as caught:
        build(typo)
    message = str(caught.value)
    assert f"type={typo!r} is not an optimizer name" in message and suggestion in message
    assert "mmengine_optim.<name>" in message


def test_bare_colossalai_wrapper_is_ours_and_trains_a_step():
    """mmengine's own ColossalAIOptimWrapper needs ColossalAI's Booster (not installed here)."""
    wrapper = build("HybridAdam", "ColossalAIOptimWrapper")
    assert type(wrapper) is mmengine_optim.ColossalAIOptimWrapper
    model = torch.nn.Linear(3, 2)
    wrapper = build_optim_wrapper(model, dict(type="ColossalAIOptimWrapper", optimizer=dict(type="FusedSGD", lr=0.5)))
    before = model.weight.detach().clone()
    with wrapper.optim_context(model):
        loss = model(torch.ones(1, 3)).sum()
    wrapper.update_params(loss)
    assert not torch.equal(model.weight, before)


def _python(code: str, *path: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, *sys.path])}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=900,
                         env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
def test_custom_imports_config_trains_with_bare_names(tmp_path):
    """A config file as a user writes it, through mmengine's Runner."""
    config = tmp_path / "cfg.py"
    config.write_text(textwrap.dedent("""
        custom_imports = dict(imports=['mmengine_optim'], allow_failed_imports=False)
        optim_wrapper = dict(type='ColossalAIOptimWrapper', optimizer=dict(type='FusedAdam', lr=0.01))
    """))
    out = _python(f"""
        import torch
        from mmengine.config import Config
        from mmengine.model import BaseModel
        from mmengine.runner import Runner

        class Model(BaseModel):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(2, 1)
            def forward(self, inputs, data_samples=None, mode='tensor'):
                return dict(loss=self.net(inputs).pow(2).mean())

        cfg = Config.fromfile({str(config)!r})
        runner = Runner(model=Model(), work_dir={str(tmp_path)!r}, optim_wrapper=cfg.optim_wrapper,
                        train_dataloader=torch.utils.data.DataLoader([dict(inputs=torch.ones(2))] * 2, batch_size=1),
                        train_cfg=dict(by_epoch=False, max_iters=2), default_hooks=dict(checkpoint=None),
                        log_level='WARNING', cfg=cfg)
        runner.train()
        print('RESULT', type(runner.optim_wrapper).__module__, type(runner.optim_wrapper.optimizer).__module__)
    """)
    (result,) = [line.split()[1:] for line in out.splitlines() if line.startswith("RESULT ")]
    assert result == ["mmengine_optim.colossalai_wrapper", "fused_optim.adam"]


@pytest.mark.slow
def test_with_deepspeed_installed_bare_fusedadam_is_left_to_it_and_the_error_says_what_to_write(tmp_path):
    """mmengine's DeepSpeedStrategy registers DeepSpeed's FusedAdam bare (without force) where
    DeepSpeed is installed; a config naming it without that strategy is told the scoped name."""
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("")  # what mmengine's import finds
    out = _python("""
        import torch
        import mmengine_optim
        from mmengine.optim import build_optim_wrapper
        from mmengine.registry import OPTIMIZERS
        print('RESULT', 'FusedAdam' in OPTIMIZERS.module_dict)
        try:
            build_optim_wrapper(torch.nn.Linear(2, 1), dict(optimizer=dict(type='FusedAdam', lr=0.1)))
        except KeyError as err:
            print('RESULT', err)
        wrapper = build_optim_wrapper(torch.nn.Linear(2, 1), dict(optimizer=dict(type='mmengine_optim.FusedAdam')))
        print('RESULT', type(wrapper.optimizer).__module__)
    """, str(tmp_path))
    lines = [line.removeprefix("RESULT ") for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines[0] == "False"
    assert "bare name is DeepSpeed's" in lines[1] and "write type='mmengine_optim.FusedAdam'" in lines[1]
    assert lines[2] == "fused_optim.adam"
