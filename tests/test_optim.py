"""The optimizers: AstrAI's parameter splits and optimizer.pt layouts, the Newton-Schulz dtype, Nora and Mano's
updates against AstrAI's own classes (its venv, a subprocess) and across two real gloo ranks."""

import copy
import json
from pathlib import Path

import pytest
import torch
from astrai_oracle import needs_astrai, run_astrai
from conftest import tiny_config
from equality import assert_same_training

from astrai_fabric.checkpoint.state import load_optimizer_state, load_sharded_optimizer_state
from astrai_fabric.errors import CheckpointError
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.optim import (
    MuonNS,
    OptimArgs,
    build_optimizer,
    is_matrix_param,
    newton_schulz,
    optimizer_groups,
    optimizer_state_bytes,
    resolve_ns_dtype,
    resolve_spread_replicated,
)


def test_split_matches_astrai_counts():
    model = AutoRegressiveLM(tiny_config(tie_word_embeddings=False))
    optimizer = build_optimizer(model, OptimArgs("muon_adamw", lr=1e-3, weight_decay=0.1))
    # AstrAI reports 14 Muon and 7 AdamW tensors for a 2-layer untied model (its ``astrai/optim/muon_adamw.py`` split).
    assert len(optimizer.muon.param_groups[0]["params"]) == 14
    assert len(optimizer.adamw.param_groups[0]["params"]) == 7
    assert optimizer.adamw.param_groups[0]["weight_decay"] == 0.0
    assert optimizer.adamw.param_groups[0]["betas"] == (0.9, 0.95)
    assert not is_matrix_param("module._orig_mod.embed_tokens.weight", torch.zeros(2, 2))


def step(model, optimizer):
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    model(ids)["logits"].float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_optimizer_state_layout_is_astrai():
    model = AutoRegressiveLM(tiny_config())
    optimizer = build_optimizer(model, OptimArgs("muon_adamw", lr=1e-3, weight_decay=0.1))
    step(model, optimizer)
    state = optimizer.state_dict()
    assert list(state) == ["muon", "adamw"]
    assert set(state["muon"]["state"][0]) == {"momentum_buffer"}
    assert set(state["adamw"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert "ns_dtype" not in state["muon"]["param_groups"][0]  # torch's group keys only
    other = build_optimizer(copy.deepcopy(model), OptimArgs("muon_adamw", lr=1e-3, weight_decay=0.1))
    other.load_state_dict(state)
    with pytest.raises(CheckpointError, match="another optimizer"):
        other.load_state_dict({"nora": None, "nadamw": None})


def test_bfloat16_is_exactly_torch_muon():
    torch.manual_seed(0)
    ours = AutoRegressiveLM(tiny_config())
    theirs = copy.deepcopy(ours)
    optimizer = build_optimizer(ours, OptimArgs("muon_adamw", lr=1e-2, weight_decay=0.1, ns_dtype=torch.bfloat16))
    matrices = [p for n, p in theirs.named_parameters() if is_matrix_param(n, p)]
    reference = torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    step(ours, optimizer)
    step(theirs, reference)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if is_matrix_param(name, a):
            assert torch.equal(a, b), name


def test_one_process_float32_step_is_the_loop_it_always_was():
    """One process never takes the owners' path (issue 42): torch's Muon step with our Newton-Schulz, bit for bit."""
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    sizes = ((12, 8), (8, 12))

    def fixed(shape, seed):
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    params = [torch.nn.Parameter(fixed(s, i)) for i, s in enumerate(sizes)]
    expected = [p.detach().clone() for p in params]
    buffers = [torch.zeros_like(p) for p in params]
    optimizer = MuonNS(params, ns_dtype=torch.float32, **settings)
    assert optimizer.owner_plan() is None and optimizer.describe_layout().startswith("one process")
    for step_index in range(2):
        for index, (param, reference, buf) in enumerate(zip(params, expected, buffers, strict=True)):
            grad = fixed(param.shape, 10 * step_index + index)
            param.grad = grad
            buf.lerp_(grad, 1 - 0.95)
            update = newton_schulz(grad.lerp(buf, 0.95), (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
            reference.mul_(1 - 0.02 * 0.1).add_(update, alpha=-0.02 * 0.2 * max(param.shape) ** 0.5)
        optimizer.step()
    for param, reference in zip(params, expected, strict=True):
        assert torch.equal(param.detach(), reference)


def test_float32_iteration_is_closer_to_exact_arithmetic():
    grad = torch.randn(48, 24, generator=torch.Generator().manual_seed(0))
    coefficients = (3.4445, -4.7750, 2.0315)
    exact = newton_schulz(grad.double(), coefficients, 5, 1e-7, torch.float64)
    error32 = (newton_schulz(grad, coefficients, 5, 1e-7, torch.float32).double() - exact).abs().max()
    error16 = (newton_schulz(grad, coefficients, 5, 1e-7, torch.bfloat16).double() - exact).abs().max()
    assert error32 < 1e-5 < error16


def test_our_dtype_never_changes_torch_muon_elsewhere():
    param = torch.nn.Parameter(torch.randn(8, 4))
    ours = MuonNS([param], lr=0.1, ns_dtype=torch.float32)
    param.grad = torch.randn(8, 4)
    ours.step()
    # A plain torch Muon in the same process still runs torch's bf16 iteration.
    a, b = torch.nn.Parameter(torch.ones(8, 4)), torch.nn.Parameter(torch.ones(8, 4))
    grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    a.grad, b.grad = grad.clone(), grad.clone()
    torch.optim.Muon([a], lr=0.1).step()
    MuonNS([b], lr=0.1, ns_dtype=torch.bfloat16).step()
    assert torch.equal(a, b)


def test_auto_settings_depend_on_the_device():
    assert resolve_ns_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_ns_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_ns_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    # DDP's Muon spread: on where bench/muon_distributed.py measured it faster (CPU), off elsewhere unless asked.
    assert resolve_spread_replicated(None, "cpu") and not resolve_spread_replicated(None, "cuda")
    assert resolve_spread_replicated(True, "cuda") and not resolve_spread_replicated(False, "cpu")


def test_adamw_decays_matrices_only():
    optimizer = build_optimizer(AutoRegressiveLM(tiny_config()), OptimArgs("adamw", lr=1e-3, weight_decay=0.1))
    decay, no_decay = optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert len(decay["params"]) == 14 and len(no_decay["params"]) == 6  # tied: one embedding, 5 norms


# --- nora_nadamw and mano_adamw ---------------------------------------------------------------------------------


def role_model(tied: bool = False, **overrides) -> AutoRegressiveLM:
    torch.manual_seed(0)
    return AutoRegressiveLM(tiny_config(tie_word_embeddings=tied, **overrides))


def fixed_gradient(step_index: int, param_index: int, shape: torch.Size) -> torch.Tensor:
    """Seeded by (step, parameter position): the same on every side (this process, the 2-rank worker, AstrAI's)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step_index + param_index))


def fixed_gradients(model, step_index: int) -> None:
    for index, param in enumerate(model.parameters()):
        param.grad = fixed_gradient(step_index, index, param.shape)


def test_role_split_is_astrai_and_puts_every_matrix_in_nora():
    model = role_model()
    optimizer = build_optimizer(model, OptimArgs("nora_nadamw", lr=1e-3, weight_decay=0.1, nora_weight_decay=0.02))
    nora_group, nadamw_group = optimizer.param_groups  # AstrAI's NAdamW decay group is empty, so left out (B18)
    names = {id(p): n for n, p in model.named_parameters()}
    rest = [names[id(p)] for p in nadamw_group["params"]]
    # 14 linear weights to Nora; embeddings, norms and the (untied) head to NAdamW without decay, in model order.
    assert len(nora_group["params"]) == 14 and all(
        "proj" in names[id(p)] or "mlp" in names[id(p)] for p in nora_group["params"]
    )
    assert rest == ["embed_tokens.weight", *[n for n in names.values() if "norm" in n], "lm_head.weight"]
    assert (nora_group["lr"], nora_group["weight_decay"], nadamw_group["weight_decay"]) == (5e-3, 0.02, 0.0)
    mano = build_optimizer(model, OptimArgs("mano_adamw", lr=1e-3, weight_decay=0.1))
    assert [len(g["params"]) for g in mano.param_groups] == [14, 7]
    assert [g["weight_decay"] for g in mano.param_groups] == [0.1, 0.0]
    assert mano.parts["adamw"].param_groups[0]["betas"] == (0.9, 0.95)


def test_state_layout_is_astrai_and_refuses_other_layouts():
    model = role_model()
    optimizer = build_optimizer(model, OptimArgs("nora_nadamw", lr=1e-3, weight_decay=0.1))
    fixed_gradients(model, 0)
    optimizer.step()
    state = optimizer.state_dict()
    assert list(state) == ["nora", "nadamw"]
    assert set(state["nora"]["state"][0]) == {"momentum_buffer"}
    assert state["nadamw"]["state"][0]["step"] == 1 and set(state["nadamw"]["state"][0]) == {"step", "m", "v"}
    assert set(state["nora"]["param_groups"][0]) == {
        "lr",
        "weight_decay",
        "momentum",
        "beta",
        "nesterov",
        "eps",
        "params",
    }
    other = build_optimizer(copy.deepcopy(model), OptimArgs("nora_nadamw", lr=1e-3, weight_decay=0.1))
    other.load_state_dict(state)
    assert torch.equal(
        other.parts["nadamw"].state[other.param_groups[1]["params"][0]]["m"], state["nadamw"]["state"][0]["m"]
    )
    with pytest.raises(CheckpointError, match="another optimizer"):
        other.load_state_dict({"muon": None, "adamw": None})
    with pytest.raises(CheckpointError, match="another model"):
        other.load_state_dict({"nora": None, "nadamw": state["nadamw"]})  # a LoRA run's state: no Nora part


def test_mano_alternates_its_normalised_dimension_across_a_resume():
    """Step 1 normalises columns, step 2 rows (each at 0.2 * lr * sqrt(length)); the counter is in optimizer.pt,
    so a resumed optimizer takes the row step next."""
    lr = 1e-2
    model = role_model()
    optimizer = build_optimizer(model, OptimArgs("mano_adamw", lr=lr, weight_decay=0.0))
    weight = model.layers[0].mlp.up.weight  # [24, 16]
    for step, dim in enumerate((0, 1)):
        before = weight.detach().clone()
        fixed_gradients(model, step)
        optimizer.step()
        direction = (before - weight.detach()) / (lr * 0.2 * weight.shape[dim] ** 0.5)
        torch.testing.assert_close(direction.norm(dim=dim), torch.ones(weight.shape[1 - dim]), atol=1e-5, rtol=0)
        if step == 0:
            resumed = build_optimizer(model, OptimArgs("mano_adamw", lr=lr, weight_decay=0.0))
            resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            optimizer = resumed
    assert optimizer.state_dict()["mano"]["param_groups"][0]["steps"] == 2


def test_mano_takes_its_own_momentum_not_muons():
    optimizer = build_optimizer(
        role_model(),
        OptimArgs("mano_adamw", 1e-3, 0.1, momentum=0.5, nesterov=True, mano_momentum=0.8, mano_nesterov=False),
    )
    group = optimizer.parts["mano"].param_groups[0]
    assert (group["momentum"], group["nesterov"]) == (0.8, False)  # AstrAI would give 0.5 and True (B17)


def test_a_lora_run_has_no_matrix_part():
    from astrai_fabric.lora import LoRASpec, inject

    model = role_model()
    inject(model, LoRASpec(r=2, alpha=4, targets=("q_proj",)), seed=0)
    optimizer = build_optimizer(model, OptimArgs("nora_nadamw", 1e-3, 0.1))
    assert optimizer.parts["nora"] is None and list(optimizer.state_dict()) == ["nora", "nadamw"]
    assert optimizer.state_dict()["nora"] is None  # AstrAI's None slot: LoRA's adapters are NAdamW's, no decay
    fixed_gradients(model, 0)
    optimizer.step()
    resumed = build_optimizer(model, OptimArgs("nora_nadamw", 1e-3, 0.1))
    load_optimizer_state(resumed, copy.deepcopy(optimizer.state_dict()), Path("ckpt/optimizer.pt"))  # the resume path
    assert_close_state(resumed.state_dict(), optimizer.state_dict())
    full = build_optimizer(role_model(), OptimArgs("nora_nadamw", 1e-3, 0.1))
    with pytest.raises(CheckpointError, match="ckpt/optimizer.pt: does not fit this run's optimizer"):
        load_optimizer_state(full, optimizer.state_dict(), Path("ckpt/optimizer.pt"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process saving, as intended
def test_sharded_state_resumes_with_nadamws_integer_step(tmp_path):
    """``--sharded_checkpoint``'s path (torch distributed checkpoint, here in one process): NAdamW's ``step`` is an
    int, which distributed checkpoint loads beside the state entry rather than into it."""
    import torch.distributed.checkpoint as dcp

    model = role_model()
    optimizer = run_ours(model, "nora_nadamw", steps=2)
    dcp.save({"optimizer": optimizer.state_dict()}, checkpoint_id=tmp_path / "state")
    resumed = build_optimizer(model, OptimArgs("nora_nadamw", **ORACLE_SETTINGS["nora_nadamw"]))
    load_sharded_optimizer_state(resumed, tmp_path / "state", model)
    assert resumed.state_dict()["nadamw"]["state"][0]["step"] == 2
    assert_close_state(resumed.state_dict(), optimizer.state_dict())


def test_state_bytes_count_one_momentum_per_matrix_entry():
    model = role_model()
    matrices = sum(p.numel() for p in optimizer_groups(model, OptimArgs("nora_nadamw", 1e-3, 0.1))[0].params)
    total = sum(p.numel() for p in model.parameters())
    nora = optimizer_state_bytes(optimizer_groups(model, OptimArgs("nora_nadamw")))
    assert nora == 4 * (matrices + 2 * (total - matrices))
    assert optimizer_state_bytes(optimizer_groups(model, OptimArgs("mano_adamw"))) == nora


# Settings AstrAI's bugs do not touch: its classes take momentum and decay directly (B17 is in its CLI), and Nora's
# decay is given (B18 is about its default).
ORACLE_SETTINGS = {
    "nora_nadamw": dict(lr=1e-3, weight_decay=0.1, nora_lr=1e-2, nora_weight_decay=0.05, nora_beta=0.9,
                        nora_momentum=0.8),
    "mano_adamw": dict(lr=1e-2, weight_decay=0.05, mano_momentum=0.9, mano_nesterov=True),
    "mano_adamw_plain": dict(lr=1e-2, weight_decay=0.0, mano_momentum=0.8, mano_nesterov=False),
}  # fmt: skip
ORACLE_STEPS = 4


def astrai_kwargs(settings: dict) -> dict:
    """AstrAI's class arguments for our ``build_optimizer`` keywords (its Mano takes ``momentum``/``nesterov``)."""
    renames = {"mano_momentum": "momentum", "mano_nesterov": "nesterov"}
    return {renames.get(key, key): value for key, value in settings.items()}


def run_ours(model, setting: str, steps: int):
    optimizer = build_optimizer(model, OptimArgs(setting.removesuffix("_plain"), **ORACLE_SETTINGS[setting]))
    for step_index in range(steps):
        fixed_gradients(model, step_index)
        optimizer.step()
    return optimizer


@pytest.fixture(scope="module")
def astrai_steps(tmp_path_factory):
    """AstrAI's own NoraNAdamW and ManoAdamW (its venv, one subprocess) on AstrAI's model loaded with our float32
    weights, stepped on the same seeded gradients: their parameters and optimizer states after each setting."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("astrai_optim")
    model = role_model()
    (root / "config.json").write_text(json.dumps(model.config.to_dict()))
    save_file(model.state_dict(), str(root / "model.safetensors"))
    params = list(model.parameters())
    gradients = [
        [fixed_gradient(step, index, p.shape) for index, p in enumerate(params)] for step in range(ORACLE_STEPS)
    ]
    torch.save(gradients, root / "gradients.pt")
    settings = {name: astrai_kwargs(values) for name, values in ORACLE_SETTINGS.items()}
    run_astrai(f"""
        import copy, torch
        from safetensors.torch import load_file
        from astrai.config.model_config import AutoRegressiveLMConfig
        from astrai.model.transformer import AutoRegressiveLM
        from astrai.optim import ManoAdamW, NoraNAdamW
        base = AutoRegressiveLM(AutoRegressiveLMConfig.from_file("{root / "config.json"}"))
        base.load_state_dict(load_file("{root / "model.safetensors"}"), strict=True)
        gradients = torch.load("{root / "gradients.pt"}")
        results = {{}}
        for setting, kwargs in {settings!r}.items():
            model = copy.deepcopy(base)
            optimizer = (NoraNAdamW if setting.startswith("nora") else ManoAdamW)(model, **kwargs)
            for step in gradients:
                for param, grad in zip(model.parameters(), step, strict=True):
                    param.grad = grad.clone()
                optimizer.step()
            results[setting] = {{"params": dict(model.named_parameters()), "state": optimizer.state_dict()}}
        torch.save(results, "{root / "astrai.pt"}")
    """)
    return torch.load(root / "astrai.pt", weights_only=True)


def assert_close_state(ours, theirs, where=""):
    """Same structure and plain values; tensors equal to 1e-5 (float32 on both sides)."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype, where
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0, msg=where)
    elif isinstance(theirs, dict):
        assert sorted(ours, key=str) == sorted(theirs, key=str), (where, sorted(ours), sorted(theirs))
        for key, value in theirs.items():
            assert_close_state(ours[key], value, f"{where}.{key}")
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs), where
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_close_state(a, b, f"{where}[{index}]")
    else:
        assert ours == theirs, (where, ours, theirs)


@needs_astrai
@pytest.mark.parametrize("setting", ORACLE_SETTINGS)
def test_updates_and_state_match_astrai(astrai_steps, setting):
    """4 steps from the same float32 weights and gradients: the parameters moved as AstrAI's own class moves them
    (tests/equality.py), and optimizer.pt (layout, indices, group keys, values) equals its state within 1e-5."""
    model = role_model()
    optimizer = run_ours(model, setting, ORACLE_STEPS)
    theirs = astrai_steps[setting]
    start = {name: param.detach() for name, param in role_model().named_parameters()}
    ours = {name: param.detach() for name, param in model.named_parameters()}
    assert [name for name in ours if torch.equal(ours[name], start[name])] == []  # every parameter moved
    assert_same_training(ours, theirs["params"], start)
    assert_close_state(optimizer.state_dict(), theirs["state"])


SHARDED_SETTINGS = ("nora_nadamw", "mano_adamw")
SHARDED_STEPS = 3  # Mano: columns, rows, columns
UNEVEN = dict(intermediate_size=25)  # the MLP's shards are uneven on both dimensions


def sharded_worker(out: str) -> None:
    """Each setting with every parameter a DTensor sharded on dim 0 (FSDP's placement) and on its last dim (tensor
    parallelism's row-wise one), over 2 gloo ranks; rank 0 saves the gathered parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    results = {}
    for setting in SHARDED_SETTINGS:
        for dim in (0, 1):
            model = role_model(**UNEVEN)
            for module in model.modules():
                for name, param in list(module.named_parameters(recurse=False)):
                    placement = [Shard(min(dim, param.dim() - 1))]
                    setattr(module, name, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, placement)))
            optimizer = build_optimizer(model, OptimArgs(setting, **ORACLE_SETTINGS[setting]))
            for step_index in range(SHARDED_STEPS):
                for index, param in enumerate(model.parameters()):
                    grad = fixed_gradient(step_index, index, param.shape)
                    param.grad = distribute_tensor(grad, mesh, param.placements)
                optimizer.step()
            results[f"{setting}_dim{dim}"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def test_sharded_updates_equal_one_process(tmp_path):
    """Where an update reduces along a sharded dimension (Nora's rows under last-dim shards, Mano's columns under
    FSDP's row shards) the shards gather it; 2 real gloo ranks move the parameters as one process does."""
    from spawn import run_ranks

    run_ranks(sharded_worker, 2, str(tmp_path / "sharded.pt"))
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)
    start = {name: param.detach() for name, param in role_model(**UNEVEN).named_parameters()}
    for setting in SHARDED_SETTINGS:
        model = role_model(**UNEVEN)
        run_ours(model, setting, SHARDED_STEPS)
        one_process = {name: param.detach() for name, param in model.named_parameters()}
        for dim in (0, 1):
            assert_same_training(sharded[f"{setting}_dim{dim}"], one_process, start)
