"""LoRA fine-tuning under the Engine, through Hugging Face `peft` (the optional extra ``lora``).

`apply_lora` injects peft's LoRA layers into the model in place (``peft.inject_adapter_in_model``:
no PeftModel wrapper, so the module paths the parallel plan names stay as they are) and freezes
every other parameter; the optimizer then holds the adapters only (`optim.OptimizerRecipe` keeps
parameters that require a gradient). It runs on the reference transformer (``wq wk wv wo w1 w2
w3``) and on Hugging Face Llama-style models (``q_proj ... down_proj``), before data parallelism:
DDP reduces the adapters' gradients only; FSDP2 shards each block's frozen and trainable
parameters together and reduces the trainable ones. Tensor parallelism is not run with LoRA (the
plan's Colwise/Rowwise styles take plain ``nn.Linear`` modules, which peft wraps).

`adapter_state_dict` / `save_adapters` / `load_adapters` move the adapters alone, in peft's files
(``adapter_model.safetensors`` with ``base_model.model.`` keys, ``adapter_config.json``), so a
fine-tune is a few megabytes and loads with ``PeftModel.from_pretrained`` on the same base.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core._lora import LoraSpec
    from autosearch.core.strategy import Strategy

PEFT_PREFIX = "base_model.model."  # what PeftModel's saved keys start with
ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
# LoraSpec target -> module name, by naming convention (gated MLP / GPT-style MLP)
MODULE_NAMES = {
    "reference": (
        {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w1", "up": "w3", "down": "w2"},
        {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "up": "w1", "down": "w2"},
    ),
    "hf": (
        {
            "q": "q_proj",
            "k": "k_proj",
            "v": "v_proj",
            "o": "o_proj",
            "gate": "gate_proj",
            "up": "up_proj",
            "down": "down_proj",
        },
        None,
    ),
}


def peft_missing() -> str | None:
    """Why peft cannot be imported (with the fix), or None."""
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        return (
            f"LoRA under the Engine needs Hugging Face peft ({exc}); install it with "
            "pip install 'autosearch[lora]'"
        )
    return None


def lora_problems(strategy: "Strategy") -> list[str]:
    """What keeps the Engine from running `strategy` with LoRA adapters (empty: nothing)."""
    problems = []
    missing = peft_missing()
    if missing:
        problems.append(missing)
    if strategy.tp > 1:
        problems.append(
            f"tp={strategy.tp} with LoRA: the Engine's tensor-parallel plan shards plain "
            "nn.Linear modules and peft wraps them; use tp=1 (dp, zero_stage 3, pp or cp "
            "instead), or train without lora"
        )
    if strategy.fp8 != "none":
        problems.append(
            f"fp8={strategy.fp8} with LoRA: torchao's Float8Linear and peft's LoRA layers do "
            "not wrap one another in the Engine; use fp8=none"
        )
    return problems


def target_modules(model: nn.Module, lora: "LoraSpec") -> list[str]:
    """The module-name suffixes peft targets for `lora` in `model` (its naming convention)."""
    from autosearch.core._lora import FUSED

    fused = [t for t in lora.targets or () if t in FUSED]
    if fused:
        raise SpecError(
            f"LoRA targets {', '.join(fused)} are adapters on Megatron-Core's fused matrices; "
            "the Engine's models have separate projections: target "
            f"{', '.join(p for t in fused for p in FUSED[t])} instead"
        )
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for convention, (gated, plain) in MODULE_NAMES.items():
        table = gated if "w3" in names or "gate_proj" in names else plain
        if table is None or not set(table.values()) & names:
            continue
        missing = [t for t in lora.targets or () if table.get(t) not in names]
        if missing:
            raise SpecError(
                f"LoRA targets {', '.join(missing)} have no module in this {convention} model "
                f"(it has {', '.join(sorted(set(table.values()) & names))}); drop them"
            )
        return [table[t] for t in lora.targets or ()]
    raise SpecError(
        "LoRA under the Engine targets the reference transformer (wq ... w3) or Hugging Face "
        "Llama-style models (q_proj ... down_proj); this model has neither naming. Train it "
        "without lora, or apply peft yourself before handing the model to the Engine"
    )


def apply_lora(model: nn.Module, lora: "LoraSpec") -> nn.Module:
    """Inject LoRA adapters (rank, alpha, targets of `lora`) into `model` in place and freeze
    everything else; returns `model`. B starts at zero, so the model computes what it did."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha if lora.alpha is not None else lora.rank,  # type: ignore[arg-type]
        target_modules=target_modules(model, lora),
        lora_dropout=0.0,
        bias="none",
    )
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model.lora_config_ = config  # type: ignore[assignment]  # what save_adapters writes
    return model


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_state_dict(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The adapters of the model parts, whole (DTensor shards gathered), by their names in the
    unwrapped model (peft's names without the adapter name: ``layers.0.attention.wq.lora_A.
    weight``). Every rank must call it (gathering is collective)."""
    from autosearch.engine.optim import clean_name

    out = {}
    for part in parts:
        for name, p in part.named_parameters():
            if not is_adapter(name):
                continue
            tensor = p.full_tensor() if hasattr(p, "full_tensor") else p
            key = clean_name(name, ddp=True).replace(".default.", ".")
            out[key] = tensor.detach().to("cpu", torch.float32).clone()
    return out


def save_adapters(parts: list[nn.Module], path: str, *, config=None) -> None:
    """Write the adapters in peft's format into folder `path` (rank 0 writes; every rank must
    call it)."""
    import torch.distributed as dist

    state = adapter_state_dict(parts)
    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold different ones
        states: list = [None] * dist.get_world_size()
        dist.all_gather_object(states, state)
        state = {k: v for s in states for k, v in s.items()}
        if dist.get_rank() != 0:
            return
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({PEFT_PREFIX + k: v.contiguous() for k, v in state.items()}, _file(path))
    if config is not None:
        with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config.to_dict(), f, indent=1, default=list)


def load_adapters(parts: list[nn.Module], path: str) -> int:
    """Copy the adapters saved in folder `path` into the model parts (each rank its shards);
    returns how many tensors were loaded. A missing or extra adapter is refused by name."""
    from safetensors.torch import load_file

    from autosearch.engine.optim import clean_name

    saved = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(_file(path)).items()}
    found = 0
    with torch.no_grad():
        for part in parts:
            for name, p in part.named_parameters():
                if not is_adapter(name):
                    continue
                key = clean_name(name, ddp=True).replace(".default.", ".")
                if key not in saved:
                    raise SpecError(f"{path}: no adapter {key!r}; was it saved from this model?")
                value = saved.pop(key).to(p.dtype)
                mesh = getattr(p, "device_mesh", None)
                if mesh is not None:  # a DTensor shard: this rank's part of the whole
                    from torch.distributed.tensor import distribute_tensor

                    placements = getattr(p, "placements")  # noqa: B009  (a DTensor's)
                    value = distribute_tensor(value.to(p.device), mesh, placements)
                p.copy_(value)
                found += 1
    if found == 0:
        raise SpecError("the model has no LoRA adapters to load into; build it with lora")
    return found


def _file(path: str) -> str:
    return os.path.join(path, ADAPTER_FILE)
