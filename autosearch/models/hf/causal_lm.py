"""Hugging Face ``transformers`` causal LMs of the Llama layout under the Engine, and the base the
other families' wrappers build on (`autosearch.models.hf.families`).

`HFCausalLM` wraps a ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` (or any
model of those ``model_type``s with the same layout) without copying it, and gives the Engine what
it needs to run every strategy:

* a forward that skips removed modules, so a pipeline stage is the same module with the
  embeddings (first stage) or the final norm and head (last stage) set to ``None``;
* the decoder layers in an ``nn.ModuleDict`` keyed "0", "1", ... instead of HF's ``ModuleList``,
  so parameter names stay the ones of the full model on every stage: the state dict keys are
  exactly the HF model's (``model.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``), and a
  checkpoint loads back into ``transformers`` (`save_pretrained`);
* an attention core module per layer (``self_attn.core``): HF calls its attention kernel as a
  function picked from ``config._attn_implementation``; we register one more entry in
  ``transformers``' `AttentionInterface` that calls the layer's core module, which runs HF's own
  SDPA attention. Selective recompute checkpoints that module (Korthikanti et al. 2022);
* the tensor-parallel plan (Megatron column/row split with sequence parallel, as torchtitan
  writes it for Llama), and the ModelSpec read from the config for `Engine.cost` and `tune`.

The Engine wraps a supported ``transformers`` model by itself (``Engine(lambda:
LlamaForCausalLM(config), ...)``); `HFCausalLM` is public for users who want the plan or the spec.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.core.hf_config import LLAMA_LIKE
from autosearch.core.model_spec import ModelSpec, unbuilt
from autosearch.distributed.plan import ParallelPlan

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.distributed.context_parallel import ContextParallel
    from autosearch.models.moe import MoE

ATTN_IMPLEMENTATION = "autosearch_core"


class AttentionCore(nn.Module):
    """softmax(QK^T / sqrt(d)) V of one layer, by transformers' SDPA attention function.

    Holds what that function reads from its module (the GQA group count, causality), so it
    works on the heads a tensor-parallel rank holds: the group count is the same there.
    """

    # Under context parallel (set by the Engine): this rank's queries attend over the whole
    # sequence (`autosearch.distributed.context_parallel`).
    context_parallel: "ContextParallel | None" = None

    def __init__(self, num_key_value_groups: int):
        super().__init__()
        self.num_key_value_groups = num_key_value_groups
        self.is_causal = True

    def forward(self, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.context_parallel is not None:
            out = self.context_parallel.attention(
                query,
                key,
                value,
                dropout_p=kwargs.get("dropout", 0.0) if self.training else 0.0,
                scale=kwargs.get("scaling"),
            )
            return out.transpose(1, 2).contiguous(), None  # as transformers' SDPA returns it
        return sdpa_attention_forward(self, query, key, value, attention_mask, **kwargs)


def _core_attention(module, query, key, value, attention_mask, **kwargs):
    """The `AttentionInterface` entry: run the calling attention layer's core module."""
    return module.core(query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _core_attention)


def has_llama_layout(model, model_types: tuple[str, ...] | None = None) -> bool:
    """Whether `model` is a causal LM of a family `HFCausalLM` runs (a transformers model or a
    subclass of one: config.model_type llama / mistral / qwen2 (or one of `model_types`),
    ``.model`` and ``.lm_head``)."""
    config = getattr(model, "config", None)
    return (
        getattr(config, "model_type", None) in (model_types or LLAMA_LIKE + MOE_LIKE)
        and hasattr(model, "model")
        and hasattr(model, "lm_head")
    )


def _sequence_shards(module: nn.Module) -> int:
    """How many tp ranks share the sequence of this module's input (1 without sequence parallel).

    With sequence parallel the norms are tp-replicated DTensors (`SequenceParallel`); without it
    they are not distributed over the tp mesh dimension at all.
    """
    from torch.distributed.tensor import DTensor

    weight = getattr(module, "weight", None)
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if "tp" in (mesh.mesh_dim_names or ()):
            return mesh["tp"].size()
    return 1


class MLPOutputBlock(nn.Module):
    """A transformers pre-norm decoder layer whose MLP returns ``(output, router scores)``
    (gpt-oss, Llama 4), rebuilt to use the MLP's output only: the same submodules under the
    same names (``self_attn``, the MLP under `mlp_name`, ``input_layernorm``,
    ``post_attention_layernorm``), so parameter names are transformers'."""

    def __init__(self, hf_layer: Any, mlp_name: str):
        super().__init__()
        self.self_attn = hf_layer.self_attn
        self.mlp_name = mlp_name
        setattr(self, mlp_name, getattr(hf_layer, mlp_name))
        self.input_layernorm = hf_layer.input_layernorm
        self.post_attention_layernorm = hf_layer.post_attention_layernorm

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, **kwargs):
        h, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=None,
        )
        h = hidden_states + h
        return h + getattr(self, self.mlp_name)(self.post_attention_layernorm(h))


class HFCausalLM(nn.Module):
    """A transformers Llama / Mistral / Qwen2 causal LM as the Engine runs it (see module doc).

    Args:
        hf_model: a ``*ForCausalLM`` of model_type llama, mistral or qwen2 (random or pretrained).
            Its modules are taken over, not copied.
        seq_len: training sequence length for the ModelSpec (default the config's
            ``max_position_embeddings``).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM      # doctest: +SKIP
        >>> cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
        ...                   intermediate_size=128, vocab_size=128)   # doctest: +SKIP
        >>> model = HFCausalLM(LlamaForCausalLM(cfg), seq_len=32)      # doctest: +SKIP
        >>> model(torch.zeros(2, 32, dtype=torch.long)).shape          # doctest: +SKIP
        torch.Size([2, 32, 128])
    """

    # transformers' config and module tree: which attributes exist depends on the model_type
    # (and a pipeline stage sets some modules to None), so they are typed Any here.
    config: Any
    model: Any
    lm_head: Any
    hf_class: Any
    context_parallel: "ContextParallel | None" = None  # rotary angles at global positions
    model_types: tuple[str, ...] | None = None  # a family wrapper's own (None: the Llama ones)
    hf_attn_implementation = "sdpa"  # the attention kernel of the model `hf_model` returns

    @classmethod
    def takes(cls, model: nn.Module) -> bool:
        """Whether this wrapper runs `model` (`autosearch.models.hf.families`)."""
        return has_llama_layout(model, cls.model_types)

    def __init__(self, hf_model: nn.Module, *, seq_len: int | None = None):
        super().__init__()
        if not has_llama_layout(hf_model, self.model_types):
            raise SpecError(
                f"{type(self).__name__} runs transformers causal LMs of model_type "
                f"{', '.join(self.model_types or LLAMA_LIKE + MOE_LIKE)}; got "
                f"{type(hf_model).__name__} (model_type "
                f"{getattr(getattr(hf_model, 'config', None), 'model_type', None)!r})"
            )
        self._take_over(hf_model)
        for layer in self.model.layers.values():
            attn = layer.self_attn
            attn.config = self.config
            if not hasattr(attn, "core"):
                attn.core = self._attention_core(attn)
        self.spec = ModelSpec.from_hf_config(self.config, seq_len=seq_len)
        self.router_aux_loss_coef = self._use_moe()
        self._count_moe_layers()
        self.tied_embeddings = self.lm_head.weight is self.model.embed_tokens.weight

    # ---- what every wrapper of a transformers model starts from (also dense.py, hybrid.py) -----
    def _take_over(self, hf: Any) -> None:
        """Hold the modules of the transformers model `hf` (not copies) under their own names,
        the layers in an ``nn.ModuleDict`` (module doc), with a config of our own whose attention
        implementation is the Engine's (the attention modules read the kernel's name from it), so
        the caller's config object keeps its own."""
        _register_attention()
        self.hf_class = type(hf)
        self.config = copy.deepcopy(hf.config)
        self.config._attn_implementation = ATTN_IMPLEMENTATION
        self.model = hf.model
        self.lm_head = hf.lm_head
        if isinstance(self.model.layers, nn.ModuleList):
            self.model.layers = nn.ModuleDict(
                {str(i): layer for i, layer in enumerate(self.model.layers)}
            )
        self.model.config = self.config

    def _count_moe_layers(self) -> None:
        """How many `autosearch.models.moe.MoE` layers the whole model has (kept on every
        pipeline stage), and their experts and top-k."""
        layers = moe_layers_of(self)
        self.n_moe_layers = len(layers)
        self.n_experts: int = layers[0].n_experts if layers else 0
        self.top_k: int = layers[0].top_k if layers else 0

    def _stage_input(self, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The hidden states this pipeline stage starts from and the sequence length its layers
        see: the first stage embeds the token ids; a later one takes the previous stage's hidden
        states, which under sequence parallel are this rank's shard of the sequence (the first
        norm the stage applies tells, `_sequence_shards`; an empty last pipeline chunk has only
        the final norm and the head)."""
        m = self.model
        if m.embed_tokens is not None:
            return m.embed_tokens(tokens), tokens.shape[1]
        first = next(iter(m.layers.values()), None)
        norm = first.input_layernorm if first is not None else m.norm
        return tokens, tokens.shape[1] * (_sequence_shards(norm) if norm is not None else 1)

    def _init_as_transformers(self) -> None:
        """transformers' ``_init_weights`` on every submodule, each parameter's flag that it is
        initialised cleared first (transformers' own flag; else its init functions skip it)."""
        for p in self.parameters():
            if getattr(p, "_is_hf_initialized", False):
                p._is_hf_initialized = False  # type: ignore[attr-defined]
        for module in self.modules():
            if module is not self:
                self.model._init_weights(module)

    # ---- what a family wrapper of the same layout changes (autosearch/models/hf/*.py) ----------
    def _attention_core(self, attn: Any) -> nn.Module:
        """The attention core module of one of transformers' attention layers."""
        return AttentionCore(attn.num_key_value_groups)

    def _use_moe(self) -> float:
        """Swap the sparse MLP blocks for the Engine's MoE layers; the aux-loss coefficient."""
        return use_autosearch_moe(self)

    def _adapt_tp_plan(self, plan: dict, *, sequence_parallel: bool) -> dict:
        """The Llama layout's tensor-parallel `plan` (`tp_plan`) as this family needs it: its
        own module names, its own modules' entries."""
        return plan

    def forward(
        self, tokens: torch.Tensor, balance: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (batch, seq, vocab) of token ids (batch, seq); a pipeline stage maps hidden
        states to hidden states. With transformers' auxiliary loss (`router_aux_loss_coef`) a
        stage before the last also passes on the running sums of that loss (`balance_sums`,
        over the whole sequences under tp and cp), and takes them as `balance` after the
        first."""
        m = self.model
        h, seq = self._stage_input(tokens)
        cp = self.context_parallel
        window = self.sliding_window()
        whole = seq * (cp.cp if cp is not None else 1)
        if window is not None and whole > window:
            raise SpecError(
                f"sequences of {whole} tokens are longer than the config's sliding_window="
                f"{window}; the Engine runs full causal attention, so train with sequences <= "
                "sliding_window"
            )
        if cp is not None:  # this rank's chunks of the sequence, at their global positions
            position_ids = cp.positions(seq, h.device).unsqueeze(0)
        else:
            position_ids = torch.arange(seq, device=h.device).unsqueeze(0)
        position_embeddings = m.rotary_emb(h, position_ids=position_ids)
        for layer in m.layers.values():
            h = layer(h, position_embeddings=position_embeddings, position_ids=position_ids)
            if isinstance(h, tuple):  # transformers 4.x layers return (hidden_states, ...)
                h = h[0]
        if m.norm is not None:
            h = m.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        if not self.router_aux_loss_coef:
            return h
        balance = balance_sums(self, balance)
        if self.lm_head is None:  # a pipeline stage before the last
            return h, balance
        return with_hf_aux_loss(self, h, balance, rows=self.n_moe_layers * h.shape[0] * whole)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every weight as transformers does (``_init_weights``: normal(0,
        initializer_range) for linear and embedding weights, ones for norms) and rebuild the
        rotary tables; the Engine calls it after building on the meta device (``meta_init``)."""
        self._init_as_transformers()
        init_moe(self)
        _rebuild_rotary(self)

    # ---- what the Engine asks ------------------------------------------------------------------
    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(
            blocks="model.layers",
            first_stage=("model.embed_tokens",),
            last_stage=("model.norm", "lm_head"),
            tp_plan=functools.partial(self._family_tp_plan, moe_blocks=self._moe_blocks()),
            attention_core="self_attn.core",
            check=self._check_strategy,
        )

    def _family_tp_plan(
        self, *, sequence_parallel: bool, loss_parallel: bool, moe_blocks: dict[str, bool] | None
    ) -> dict:
        """`tp_plan` with what this model's family changes in it (`_adapt_tp_plan`)."""
        plan = self.tp_plan(
            sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, moe_blocks=moe_blocks
        )
        return self._adapt_tp_plan(plan, sequence_parallel=sequence_parallel)

    def _moe_blocks(self) -> dict[str, bool] | None:
        """{block name: whether its MLP is an `autosearch.models.moe.MoE`} (None: none is)."""
        from autosearch.models.moe import MoE

        blocks = {n: isinstance(b.mlp, MoE) for n, b in self.model.layers.items()}
        return blocks if any(blocks.values()) else None

    def sliding_window(self) -> int | None:
        """The attention window, if the config restricts attention to one (Mistral, Qwen2)."""
        window = getattr(self.config, "sliding_window", None)
        if self.config.model_type == "qwen2" and not getattr(
            self.config, "use_sliding_window", False
        ):
            return None
        return window

    def _check_strategy(self, strategy) -> list[str]:
        problems = strategy.problems(self.spec)
        hub_kernels = importlib.util.find_spec("kernels") is not None
        if (
            strategy.compile
            and strategy.recompute in ("selective", "selective_op")
            and hub_kernels
        ):
            problems.append(
                f"compile=true with recompute={strategy.recompute} checkpoints inside the compiled"
                " layers, and transformers' hub-kernel wrapper (the `kernels` package, installed"
                " here) sets a context variable in each layer's forward, which torch.compile "
                "cannot trace there; use recompute=none or full with compile, or uninstall "
                "`kernels`"
            )
        return problems

    @staticmethod
    def tp_plan(
        *, sequence_parallel: bool, loss_parallel: bool, moe_blocks: dict[str, bool] | None = None
    ) -> dict:
        """Megatron-style plan (Shoeybi et al. 2019) with sequence parallel (Korthikanti et al.
        2022), as torchtitan writes it for Llama, on transformers' module names.

        Column-wise: q/k/v_proj, gate/up_proj; row-wise: o_proj, down_proj (one all-reduce, or a
        reduce-scatter with sequence parallel, per sub-layer). Embeddings split by vocabulary rows,
        lm_head by vocabulary columns. Mixture-of-experts MLPs (`moe_blocks`: {block name: its
        MLP is one}) route this rank's shard of the sequence (parallel folding,
        `autosearch.models.moe.apply_ep`), as the reference transformer's.
        """
        from torch.distributed.tensor.parallel import SequenceParallel

        from autosearch.models.hf.tp_plans import (
            LAYER,
            column_row_entries,
            llama_layout_entries,
            llama_sequence_parallel_entries,
        )

        sp = sequence_parallel
        plan = {
            **llama_layout_entries(sequence_parallel=sp, loss_parallel=loss_parallel),
            # Qwen3's per-head RMSNorms see this rank's heads (dim 2 of [b, s, heads, d]): a
            # replicated weight whose gradient is summed over tp (torchtitan's Qwen3 plan)
            LAYER + "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            LAYER + "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            **column_row_entries(
                LAYER + "mlp.", ("gate_proj", "up_proj"), "down_proj", sequence_parallel=sp
            ),
        }
        if sequence_parallel:
            plan.update(llama_sequence_parallel_entries())
            if moe_blocks:  # one entry per block: the MoE ones also hand back their shard
                from autosearch.models.moe import sequence_parallel_style

                dense = plan.pop(LAYER + "mlp")
                for name, is_moe in moe_blocks.items():
                    plan[f"model.layers.{name}.mlp"] = (
                        sequence_parallel_style() if is_moe else dense
                    )
        return plan

    # ---- back to transformers ------------------------------------------------------------------
    def hf_model(self, state_dict: dict[str, torch.Tensor] | None = None) -> Any:
        """A plain transformers model of the same class and config (`hf_attn_implementation`: SDPA
        unless the family has none), holding
        `state_dict` (full tensors with this module's names, as ``Engine.save(path,
        training=False)`` writes them)
        or this module's weights."""
        config = copy.deepcopy(self.config)
        config._attn_implementation = self.hf_attn_implementation
        with torch.device("meta"):
            model = self.hf_class(config)
        state = state_dict if state_dict is not None else self.state_dict()
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        unexpected = [k for k in unexpected if not k.endswith(".inv_freq")]
        missing = [k for k in missing if not (self.tied_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise SpecError(
                f"the state dict does not match {self.hf_class.__name__}: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        if self.tied_embeddings:
            model.tie_weights()
        _rebuild_rotary(model)
        return model


def _rebuild_rotary(model: nn.Module) -> None:
    """Recompute the rotary embeddings' inverse frequencies (non-persistent buffers, so neither
    checkpoints nor ``to_empty`` after a meta-device build carry them)."""
    module: Any  # a transformers rotary embedding (its attributes vary by version)
    for module in model.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor) and hasattr(
            module, "config"
        ):
            init = getattr(module, "rope_init_fn", None) or _rope_init(module)
            inv_freq, _ = init(module.config)
            device = module.inv_freq.device if not module.inv_freq.is_meta else torch.device("cpu")
            module.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq = module.inv_freq


def _rope_init(module: Any) -> Callable:
    """The function that computes a transformers rotary embedding's inverse frequencies: its
    rope type's (``rope_type``: yarn for gpt-oss, llama3 for Llama 3.1), else the default one
    (transformers 5 keeps it in a local variable of ``__init__``, not on the module)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = getattr(module, "rope_type", "default")
    if rope_type == "default":
        return module.compute_default_rope_parameters
    return ROPE_INIT_FUNCTIONS[rope_type]


def llama_from_spec(spec) -> HFCausalLM:
    """A randomly initialised transformers ``LlamaForCausalLM`` with the shape of a swiglu
    ModelSpec: the factory ``"autosearch.models.hf.causal_lm:llama_from_spec"`` that
    `Engine.tune`'s
    validation runs use to time a Llama-style HF model in new processes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    moe = ["mixture-of-experts layers (use autosearch.models.transformer.Transformer)"] * bool(
        spec.moe
    )
    if spec.ffn_activation != "swiglu" or unbuilt(spec) or moe:
        raise SpecError(
            f"llama_from_spec builds Llama-style models; {spec.name!r} has ffn_activation "
            f"{spec.ffn_activation!r}" + "".join(f"; {u}" for u in unbuilt(spec) + moe)
        )
    config = LlamaConfig(
        num_hidden_layers=spec.n_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        intermediate_size=spec.ffn_hidden_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.seq_len,
        tie_word_embeddings=spec.tied_embeddings,
    )
    return HFCausalLM(LlamaForCausalLM(config))


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def save_pretrained(
    model: nn.Module,
    folder: str,
    *,
    save_weights: Callable[[str], None],
    safe_serialization: bool = True,
) -> None:
    """Write an engine's HF model in transformers' `save_pretrained` format (config.json and
    safetensors weights), gathered from every rank's shards; rank 0 writes it.

    Args:
        model: the module the engine built (an `HFCausalLM`).
        folder: where the transformers model goes.
        save_weights: ``save_weights(path)`` writes the full state dict file (every rank calls
            it: ``Engine.save(path, training=False)``).
    """
    import os
    import shutil
    import tempfile

    import torch.distributed as dist

    if not isinstance(model, HFCausalLM):
        raise SpecError(
            "save_pretrained needs a transformers model (Llama, Mistral or Qwen2 family); this "
            f"engine runs {type(model).__name__}: use Engine.save for a DCP checkpoint or a "
            "state dict file"
        )
    tmp: list[Any] = [tempfile.mkdtemp(prefix="autosearch-hf-") if _is_rank0() else None]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(tmp, src=0)
    folder_tmp: str = tmp[0]  # rank 0's folder, on every rank
    weights = os.path.join(folder_tmp, "model.pt")
    try:
        save_weights(weights)  # every rank writes its shards; rank 0 merges them
        if _is_rank0():
            state = torch.load(weights, map_location="cpu", weights_only=True)
            model.hf_model(state).save_pretrained(folder, safe_serialization=safe_serialization)
    finally:
        if _is_rank0():
            shutil.rmtree(folder_tmp, ignore_errors=True)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


# ---- mixture of experts (Mixtral, Qwen3-MoE) ----------------------------------------------------
MOE_LIKE = ("mixtral", "qwen3_moe")


def use_autosearch_moe(model: HFCausalLM) -> float:
    """The sparse MLP blocks of Mixtral and Qwen3-MoE as the Engine's MoE (`swap_sparse_blocks`);
    the auxiliary-loss coefficient the model trains with (0 for the other families)."""
    if model.config.model_type not in MOE_LIKE:
        return 0.0
    return swap_sparse_blocks(model)


def swap_sparse_blocks(
    model: HFCausalLM, moe_class: type[MoE] | None = None, *, shared: tuple[str, ...] = ()
) -> float:
    """Replace each sparse MLP block (``mlp.gate`` + ``mlp.experts``) by a `moe_class` (default
    `autosearch.models.moe.MoE`) holding the same parameters under the same names
    (``mlp.gate.weight``, ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), which
    expert parallelism can shard; the block's modules named in `shared` (Qwen2-MoE's shared
    expert and its gate) are passed on to `moe_class` by those names. Returns the
    auxiliary-loss coefficient the model trains with: the config's ``router_aux_loss_coef``
    when ``output_router_logits`` is set (as transformers adds it to the loss), else 0."""
    from autosearch.models.moe import FusedExperts, MoE

    config = model.config
    for layer in model.model.layers.values():
        block = layer.mlp
        if not hasattr(block, "experts"):  # a dense layer (mlp_only_layers, decoder_sparse_step)
            continue
        hf_experts = block.experts
        moe = (moe_class or MoE)(
            **{name: getattr(block, name) for name in shared},
            dim=config.hidden_size,
            hidden=hf_experts.intermediate_dim,
            n_experts=hf_experts.num_experts,
            top_k=config.num_experts_per_tok,
            norm_topk_prob=getattr(config, "norm_topk_prob", True),  # Mixtral renormalises
            aux_loss_coef=0.0,  # transformers' loss is over all layers at once: the model adds it
        )
        moe.gate.weight = block.gate.weight
        moe.experts = FusedExperts(hf_experts.gate_up_proj, hf_experts.down_proj)
        moe.record_router_logits = bool(config.output_router_logits)
        layer.mlp = moe
    return float(config.router_aux_loss_coef) if config.output_router_logits else 0.0


def moe_layers_of(model: nn.Module) -> list:
    """The `autosearch.models.moe.MoE` layers of `model`, in order."""
    from autosearch.models.moe import moe_layers

    return moe_layers(model)


def balance_sums(model: HFCausalLM, sums: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (attention mask None) up to its last lines:
    the running sums ``[2, E]`` of routed top-k slots per expert (row 0, no gradient) and of
    router probabilities per expert (row 1), continued from `sums` (a previous pipeline stage's)
    over the router logits this forward recorded in `model`'s MoE layers, layer by layer with
    the same operations, so that the sums carried over pipeline stages are bitwise those of the
    whole model.

    Each tp rank routed its own tokens (parallel folding) and each cp rank holds its chunks of
    the sequence, so this stage's sums are summed over tp and cp before the carried ones are
    added: over tp with an identity backward (each rank's router gradient is its tokens', summed
    over tp by `reduce_moe_grads`), over cp with a summing backward (every cp rank adds the same
    loss, and the data-parallel reduction averages the gradients over dp x cp), as the reference
    transformer's `MoE.balance_loss` reduces its per-sequence sums."""
    layers = moe_layers_of(model)
    tp_group = layers[0].tp_group if layers else None
    cp = model.context_parallel
    reduced = tp_group is not None or cp is not None
    device = next(model.parameters()).device
    counts = torch.zeros(model.n_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(model.n_experts, dtype=torch.float32, device=device)
    if sums is not None and not reduced:
        counts, probs = sums[0].detach(), sums[1]
    # transformers' choice: histc counts in float on CPU and MPS, int32 elsewhere
    histc_dtype = torch.float32 if counts.device.type in ("cpu", "mps") else torch.int32
    for layer in layers:
        weights = torch.nn.functional.softmax(layer.router_logits.to(counts.device), dim=-1)
        _, chosen = torch.topk(weights, model.top_k, dim=-1)
        counts = counts + torch.histc(
            chosen.reshape(-1).to(histc_dtype), bins=model.n_experts, min=0, max=model.n_experts
        )
        probs = probs + weights.float().sum(dim=0)
    if not reduced:
        return torch.stack([counts, probs])
    import torch.distributed as dist

    from autosearch.models.moe import ReduceFromGroup

    if tp_group is not None:
        dist.all_reduce(counts, group=tp_group)
        probs = ReduceFromGroup.apply(probs, tp_group)
    if cp is not None:
        from torch.distributed.nn.functional import all_reduce

        dist.all_reduce(counts, group=cp.mesh.get_group())
        probs = all_reduce(probs, group=cp.mesh.get_group())
    if sums is not None:
        counts, probs = sums[0].detach() + counts, sums[1] + probs
    return torch.stack([counts, probs])


def with_hf_aux_loss(
    model: HFCausalLM, logits: torch.Tensor, sums: torch.Tensor, *, rows: int
) -> torch.Tensor:
    """`logits`, whose backward also adds ``router_aux_loss_coef`` x transformers'
    ``load_balancing_loss_func`` over every layer's router logits (Switch Transformer's loss
    over all layers' tokens together, as ``MixtralForCausalLM.forward`` adds it): its last lines
    on the `balance_sums` of all layers, `rows` = layers x tokens of the micro-batch (the whole
    sequences: under cp and tp the sums are over every rank's tokens). Under pipeline parallelism
    the earlier stages' sums came with the hidden states, and the gradient of the probability
    sums goes back with the hidden states' gradient."""
    from autosearch.models.moe import AuxLoss

    tokens_per_expert = sums[0].detach() / float(rows)
    router_prob_per_expert = sums[1] / float(rows)
    aux = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * model.n_experts
    model.aux_loss = aux.detach()
    if model.training and torch.is_grad_enabled():
        return AuxLoss.add(logits, aux * model.router_aux_loss_coef)
    return logits


def init_moe(model: HFCausalLM) -> None:
    """transformers' init of the experts it no longer recognises: normal(0,
    initializer_range), as ``MixtralPreTrainedModel._init_weights`` does."""
    from autosearch.models.moe import FusedExperts

    for module in model.modules():
        if isinstance(module, FusedExperts):
            for w in (module.gate_up_proj, module.down_proj):
                torch.nn.init.normal_(w, mean=0.0, std=model.config.initializer_range)
