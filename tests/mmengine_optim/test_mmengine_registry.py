"""mmengine_optim's registration: scoped names without imports, bare names after custom_imports,
idempotence, and coexistence with another library's ``FusedSGD``."""

import subprocess
import sys
import textwrap

import mmengine.registry as root
import pytest
import torch

import fused_optim
import mmengine_optim
from mmengine_optim import register_optimizers
from mmengine_optim.registry import deepspeed_installed

TORCH_NAMES = ("SGD", "Adam", "AdamW", "Adagrad")


def test_every_core_optimizer_is_registered_in_our_scope_and_bare():
    for name in fused_optim.list_optimizers():
        spec = fused_optim.registry.get_spec(name)
        assert root.OPTIMIZERS.get(f"mmengine_optim.{spec.cls.__name__}") is spec.cls
        assert root.OPTIMIZERS.get(f"mmengine_optim.{name}").entry == name
        assert root.OPTIMIZERS.get(name).entry == name
        if spec.cls.__name__ in TORCH_NAMES:  # bare SGD/Adam/AdamW/Adagrad stay torch.optim's
            assert root.OPTIMIZERS.get(spec.cls.__name__) is getattr(torch.optim, spec.cls.__name__)
        else:
            assert root.OPTIMIZERS.get(spec.cls.__name__) is spec.cls
    assert not deepspeed_installed()  # else DeepSpeedStrategy would register bare FusedAdam, and ours is not
    assert root.OPTIM_WRAPPERS.get("AdaScaleOptimWrapper") is mmengine_optim.AdaScaleOptimWrapper
    assert root.HOOKS.get("mmengine_optim.UpdateParamSchedulerHook") is mmengine_optim.UpdateParamSchedulerHook


def test_the_checkpoint_hook_is_registered_under_its_old_name_too():
    for name in ("PortableCheckpointHook", "WeightsOnlyCheckpointHook"):
        for key in (name, f"mmengine_optim.{name}"):
            assert root.HOOKS.get(key) is mmengine_optim.PortableCheckpointHook
    assert mmengine_optim.WeightsOnlyCheckpointHook is mmengine_optim.PortableCheckpointHook


def test_colossalai_class_names_build_the_colossal_classes():
    """Configs written for ColossalAI name its Lars / Lamb: scoped and bare, they build ours."""
    p = [torch.nn.Parameter(torch.zeros(2))]
    for alias, cls in (("Lars", fused_optim.ColossalLars), ("Lamb", fused_optim.ColossalLamb)):
        assert root.OPTIMIZERS.get(f"mmengine_optim.{alias}") is cls
        assert root.OPTIMIZERS.get(alias) is cls
        assert type(root.OPTIMIZERS.build(dict(type=f"mmengine_optim.{alias}", params=p, lr=0.1))) is cls


def test_entry_factories_apply_the_entry_defaults():
    import torch
    p = [torch.nn.Parameter(torch.zeros(2))]
    adam = root.OPTIMIZERS.build(dict(type="mmengine_optim.adam", params=p, lr=0.1))
    assert isinstance(adam, fused_optim.FusedAdam) and adam.defaults["decoupled_weight_decay"] is False
    nvlamb = root.OPTIMIZERS.build(dict(type="nvlamb", params=p))
    assert nvlamb.defaults["use_nvlamb"] is True


def test_registration_is_idempotent():
    before = dict(mmengine_optim.OPTIMIZERS.module_dict), dict(root.OPTIMIZERS.module_dict)
    register_optimizers()
    after = dict(mmengine_optim.OPTIMIZERS.module_dict), dict(root.OPTIMIZERS.module_dict)
    assert [sorted(d) for d in before] == [sorted(d) for d in after]
    assert all(before[1][k] is after[1][k] for k in before[1])  # root entries are never replaced


def _python(code):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
def test_scoped_names_need_no_import_and_another_librarys_fusedsgd_stays():
    out = _python("""
        import torch
        from mmengine.registry import OPTIMIZERS
        class FusedSGD(torch.optim.SGD):  # another library's, registered first
            pass
        OPTIMIZERS.register_module(module=FusedSGD)
        ours = OPTIMIZERS.get('mmengine_optim.FusedSGD')  # imports mmengine_optim.registry itself
        print(ours.__module__, OPTIMIZERS.get('FusedSGD') is FusedSGD, OPTIMIZERS.get('FusedLAMB').__module__)
    """)
    assert out.split()[-3:] == ["fused_optim.sgd", "True", "fused_optim.lamb"]
    assert "the bare optimizer name 'FusedSGD' belongs to __main__.FusedSGD" in out


@pytest.mark.slow
def test_bare_names_after_custom_imports(tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text("custom_imports = dict(imports=['mmengine_optim'], allow_failed_imports=False)\n"
                      "optimizer = dict(type='FusedLAMB', lr=0.01)\n")
    out = _python(f"""
        import torch
        from mmengine.config import Config
        from mmengine.registry import OPTIMIZERS
        cfg = Config.fromfile({str(config)!r})
        opt = OPTIMIZERS.build(dict(cfg.optimizer, params=[torch.nn.Parameter(torch.zeros(3))]))
        print(type(opt).__module__, type(opt).__name__)
    """)
    assert out.split()[-2:] == ["fused_optim.lamb", "FusedLAMB"]


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_torch_names_are_ours_only_in_our_scope(name):
    from mmengine.registry import DefaultScope
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert type(root.OPTIMIZERS.build(dict(type=f"mmengine_optim.{name}", params=p))) is getattr(fused_optim, name)
    assert type(root.OPTIMIZERS.build(dict(type=name, params=p))) is getattr(torch.optim, name)
    with DefaultScope.overwrite_default_scope("mmengine_optim"):  # a config with default_scope='mmengine_optim'
        assert type(root.OPTIMIZERS.build(dict(type=name, params=p))) is getattr(fused_optim, name)
