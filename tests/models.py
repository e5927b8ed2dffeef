"""The shared test model zoo: small models with fixed seeds, one factory each.

Every factory returns ``(model, example_inputs)``: ``example_inputs`` is a tuple (positional)
or a dict (keyword arguments) of ONE micro-batch, the form ``fxpipe.trace`` and
``fxpipe.compile`` take. Models are built under ``torch.manual_seed(seed)`` so two calls give
identical weights and inputs; ``dropout`` defaults to 0 so gradient checks can be bitwise.

Example::

    from tests.models import ZOO, gpt2_tiny
    model, inputs = gpt2_tiny(dropout=0.1)
    out = model(**inputs)                       # a dict of keyword inputs
    for name, factory in ZOO.items():           # every model, for parametrised tests
        model, inputs = factory()

``tied`` lists the factories whose model has tied parameters (GPT-2: ``lm_head``/``wte``).
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
import torch.nn.functional as F

if __name__ != "tests.models":
    # A second copy would register fxpipe_tests::strict_mm (below) again: torch destroys the
    # first copy's registration, and the first copy's op then runs on freed state (export
    # failed with std::bad_alloc, in some runs only).
    raise ImportError(f"the test model zoo was imported as {__name__!r}; import it as tests.models, with the "
                      f"repository root on sys.path (tests/conftest.py puts it there)")

__all__ = [
    "mlp",
    "cnn_bn",
    "transformer_encoder",
    "rmsnorm_residual",
    "BranchNet",
    "TwoBranches",
    "gpt2_tiny",
    "bert_tiny",
    "llama_tiny",
    "HF_ARCHITECTURES",
    "hf_architecture",
    "hf_batch",
    "ZOO",
    "HF",
]


def mlp(*, seed: int = 0, batch: int = 4, dropout: float = 0.0):
    """Four Linear layers with ReLU (and optional dropout); input ``(batch, 16)``."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 8),
    )
    return model, (torch.randn(batch, 16),)


class SmallCNN(nn.Module):
    """Conv-BN-ReLU twice, then pool and a linear head; BatchNorm updates running stats in
    train mode, which pipelines must keep correct."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = x.mean(dim=(2, 3))
        return self.head(self.drop(x))


def cnn_bn(*, seed: int = 0, batch: int = 4, dropout: float = 0.0):
    """:class:`SmallCNN` on ``(batch, 3, 8, 8)`` images, in train mode."""
    torch.manual_seed(seed)
    model = SmallCNN(dropout)
    return model, (torch.randn(batch, 3, 8, 8),)


def transformer_encoder(*, seed: int = 0, batch: int = 2, dropout: float = 0.0):
    """``nn.TransformerEncoder``: 2 layers, d_model 32, 4 heads, batch_first; input
    ``(batch, 8, 32)``. The fast path (nested tensors) is off in train mode."""
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=dropout, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    return model, (torch.randn(batch, 8, 32),)


class Fp32LayerNorm(nn.LayerNorm):
    """CLIP's and Whisper's LayerNorm: normalizes in fp32 whatever the input's dtype."""

    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


class Fp32Norms(nn.Module):
    """Linear layers around norms of three kinds: an fp32-computing LayerNorm (as CLIP writes
    it), a GroupNorm of an explicit ``h.float()`` (Stable Diffusion's GroupNorm32), and a plain
    LayerNorm of a linear's output (16-bit under autocast)."""

    def __init__(self, dim: int = 16, classes: int = 4):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)
        self.ln32, self.gn32, self.ln = Fp32LayerNorm(dim), nn.GroupNorm(4, dim), nn.LayerNorm(dim)

    def forward(self, x):
        h = self.ln32(torch.relu(self.a(x)))
        h = self.gn32(self.b(h).float())
        return self.head(self.ln(self.c(h)))


def fp32_norms(*, seed: int = 0, batch: int = 4):
    """:class:`Fp32Norms` on ``(batch, 16)``."""
    torch.manual_seed(seed)
    return Fp32Norms(), (torch.randn(batch, 16),)


@torch.library.custom_op("fxpipe_tests::strict_mm", mutates_args=())
def strict_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` as a model's own kernel: a custom op that autocast does not cover, and which,
    like the kernels it stands for, refuses operands of two dtypes."""
    if x.dtype != w.dtype:
        raise RuntimeError(f"strict_mm: x is {x.dtype} but w is {w.dtype}")
    return x @ w


@strict_mm.register_fake
def _strict_mm_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


def _strict_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _strict_mm_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w.t(), x.t() @ grad


strict_mm.register_autograd(_strict_mm_backward, setup_context=_strict_mm_setup)


class OwnKernel(nn.Module):
    """Linear layers around :func:`strict_mm`, fed as transformers feeds its grouped expert
    matmul: ``strict_mm(h.to(w.dtype), w.t())``, the input cast to the weight's dtype."""

    def __init__(self, dim: int = 16, classes: int = 4):
        super().__init__()
        self.a, self.head = nn.Linear(dim, dim), nn.Linear(dim, classes)
        self.w = nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.head(torch.relu(strict_mm(h.to(self.w.dtype), self.w.t())))


def own_kernel(*, seed: int = 0, batch: int = 4):
    """:class:`OwnKernel` on ``(batch, 16)``."""
    torch.manual_seed(seed)
    return OwnKernel(), (torch.randn(batch, 16),)


class MaskedScores(nn.Module):
    """One causal attention head whose masked scores are filled with the lowest value of their
    dtype, ``scores.masked_fill(~causal, torch.finfo(scores.dtype).min)``, as DeBERTa writes it,
    then mean-pooled into a classifier."""

    def __init__(self, dim: int = 16, classes: int = 4):
        super().__init__()
        self.q, self.k, self.v, self.head = (nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim),
                                             nn.Linear(dim, classes))

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        return self.head((scores.softmax(-1) @ self.v(x)).mean(1))


def masked_scores(*, seed: int = 0, batch: int = 4):
    """:class:`MaskedScores` on ``(batch, 6, 16)``."""
    torch.manual_seed(seed)
    return MaskedScores(), (torch.randn(batch, 6, 16),)


class LearnedBiasAttention(nn.Module):
    """Self-attention through ``F.scaled_dot_product_attention`` whose mask is a learned bias
    looked up by relative position (Swin's and T5's), then a head: a mask that takes a
    gradient, for which the CPU kernel picks another backend when autograd records than under
    ``no_grad``."""

    def __init__(self, seq: int = 16, dim: int = 8, heads: int = 2, classes: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Linear(dim, classes)
        self.table = nn.Parameter(torch.randn(2 * seq - 1, heads))
        position = torch.arange(seq)
        self.register_buffer("relative", position[None, :] - position[:, None] + seq - 1, persistent=False)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.table[self.relative].permute(2, 0, 1).unsqueeze(0)  # (1, heads, n, n)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.5)
        h = self.proj(h.transpose(1, 2).reshape(b, n, c))
        return self.head(torch.relu(h).mean(1))


def learned_bias_attention(*, seed: int = 0, batch: int = 4):
    """:class:`LearnedBiasAttention` on ``(batch, 16, 8)``."""
    torch.manual_seed(seed)
    return LearnedBiasAttention(), (torch.randn(batch, 16, 8),)


class RMSNorm(nn.Module):
    """RMSNorm as Llama writes it: the weight is read by a plain ``x * weight``, not by a
    module call, so the parameter reaches the graph as a bare ``get_attr``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight


class RMSResidual(nn.Module):
    """Embedding, two pre-norm residual MLP blocks, final norm and head: residual (skip)
    values cross any cut inside a block."""

    def __init__(self, vocab: int = 50, dim: int = 32, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList([RMSNorm(dim) for _ in range(2)])
        self.up = nn.ModuleList([nn.Linear(dim, 2 * dim) for _ in range(2)])
        self.down = nn.ModuleList([nn.Linear(2 * dim, dim) for _ in range(2)])
        self.drop = nn.Dropout(dropout)
        self.final_norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for norm, up, down in zip(self.norms, self.up, self.down):
            h = h + self.drop(down(torch.nn.functional.gelu(up(norm(h)))))
        return self.head(self.final_norm(h))


def rmsnorm_residual(*, seed: int = 0, batch: int = 2, dropout: float = 0.0):
    """:class:`RMSResidual` on token ids ``(batch, 8)``."""
    torch.manual_seed(seed)
    model = RMSResidual(dropout=dropout)
    return model, (torch.randint(0, 50, (batch, 8)),)


class TwoBranches(nn.Module):
    """A leaf module (``leaf_modules=TwoBranches``) whose branches own their weights: which of
    them a backward reaches depends on the data (the sign of the input's sum)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.up(x) if x.sum() > 0 else self.down(x)


class BranchNet(nn.Module):
    """Linear, :class:`TwoBranches`, tanh, Linear to 1: input ``(batch, 8)``."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), TwoBranches(), nn.Linear(8, 1)

    def forward(self, x):
        return self.c(torch.tanh(self.b(self.a(x))))


class CountedScale(nn.Module):
    """Three Linears whose output is scaled by a buffer that a training forward counts up in
    place before the second Linear and reads at the end: cut in between, training hands the
    counted value across the cut, while eval mode (no count) reads the buffer itself there.
    Input ``(batch, 4)``, output ``(batch, 2)``."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.training:
            with torch.no_grad():
                self.scale.add_(1.0)
        return self.c(torch.relu(self.b(h))) * self.scale


def _transformers():
    """Import ``transformers`` safely when the repository root is on ``sys.path``.

    transformers probes for an optional package named ``kernels``; with the repository root on
    the path it finds fxpipe's top-level ``kernels/`` folder, imports it as a top-level package
    and fails. The probe is cached, so running it once with the root off the path is enough.
    """
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if os.path.abspath(p or os.curdir) != repo]
    try:
        import transformers
        from transformers.utils import import_utils

        import_utils.is_kernels_available()
    finally:
        sys.path[:] = saved
    return transformers


def _token_inputs(batch: int, seq: int, labels: bool) -> dict:
    """``input_ids`` over the tiny vocabulary (100), and ``labels`` = the ids when asked (causal
    LMs shift them themselves and return their own loss)."""
    ids = torch.randint(0, 100, (batch, seq))
    return {"input_ids": ids, "labels": ids.clone()} if labels else {"input_ids": ids}


def gpt2_tiny(*, seed: int = 0, batch: int = 2, seq: int = 16, dropout: float = 0.0, labels: bool = False):
    """Hugging Face ``GPT2LMHeadModel`` (2 layers, 32 wide, 4 heads, vocab 100, tied
    ``lm_head``/``wte``), keyword inputs ``input_ids`` (and ``labels`` when asked, so the
    model computes its own loss)."""
    tf = _transformers()
    GPT2Config, GPT2LMHeadModel = tf.GPT2Config, tf.GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=100,
        n_positions=64,
        use_cache=False,
        bos_token_id=0,  # the defaults (50256) lie outside the tiny vocabulary and warn
        eos_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    model = GPT2LMHeadModel(config)
    return model, _token_inputs(batch, seq, labels)


def t5_tiny(*, seed: int = 0, batch: int = 2, seq: int = 8):
    """Hugging Face ``T5ForConditionalGeneration`` (2 + 2 layers, 32 wide, vocab 100) with its
    default config: ``use_cache`` on, in the model's config and in the copy its decoder stack
    keeps. Keyword inputs ``input_ids`` and ``labels``; the model computes its own loss."""
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    model = tf.T5ForConditionalGeneration(config)
    return model, _token_inputs(batch, seq, labels=True)


def bert_tiny(*, seed: int = 0, batch: int = 2, seq: int = 16, dropout: float = 0.0, labels: bool = False):
    """Hugging Face ``BertForMaskedLM`` (2 layers, 32 wide, 4 heads, vocab 100; the decoder is
    tied to the word embeddings), keyword inputs ``input_ids`` and ``attention_mask`` (the
    mask is a model input that stages other than the first read)."""
    tf = _transformers()
    BertConfig, BertForMaskedLM = tf.BertConfig, tf.BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    model = BertForMaskedLM(config)
    ids = torch.randint(0, 100, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, -3:] = 0  # some padding, so the mask matters
    inputs = {"input_ids": ids, "attention_mask": mask}
    if labels:  # masked-LM targets: every token, padding ignored
        inputs["labels"] = ids.masked_fill(mask == 0, -100)
    return model, inputs


def resnet_tiny(*, seed: int = 0, batch: int = 2, size: int = 16, labels: bool = False):
    """Hugging Face ``ResNetForImageClassification`` (two basic stages, 8 and 16 channels,
    BatchNorm everywhere: buffers a forward updates), input ``pixel_values (batch, 3, size, size)``."""
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                             layer_type="basic", num_labels=10)
    model = tf.ResNetForImageClassification(config)
    inputs = {"pixel_values": torch.randn(batch, 3, size, size)}
    if labels:
        inputs["labels"] = torch.randint(0, 10, (batch,))
    return model, inputs


def llama_tiny(*, seed: int = 0, batch: int = 2, seq: int = 16, dropout: float = 0.0, labels: bool = False):
    """Hugging Face ``LlamaForCausalLM`` (2 layers, 32 wide, 4 query heads sharing 2 key/value
    heads, rotary positions, RMSNorm — ``x * weight``, saved by reference — SwiGLU, untied
    ``lm_head``, vocab 100), keyword inputs ``input_ids`` (and ``labels`` when asked).

    Not in :data:`ZOO`, whose trace and codegen tests demand bitwise-equal gradients: the
    exported Llama graph's forward is bitwise equal to eager, but its gradients differ at the
    rounding level (~1e-11 absolute, autograd summing some contributions in another order). The
    training cases (``tests/cases.py``) compare it with the references at 1e-5, like every case."""
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = tf.LlamaForCausalLM(config)
    return model, _token_inputs(batch, seq, labels)


# name -> factory; each factory takes keyword arguments seed, batch, dropout.
ZOO = {
    "mlp": mlp,
    "cnn_bn": cnn_bn,
    "transformer_encoder": transformer_encoder,
    "rmsnorm_residual": rmsnorm_residual,
    "gpt2_tiny": gpt2_tiny,
    "bert_tiny": bert_tiny,
}

# the factories that need ``transformers``
HF = ("gpt2_tiny", "bert_tiny")


# Hugging Face architectures beyond the ones the training cases use, each as (model class, config
# class, config arguments, inputs): tiny (one or two layers, 32 wide or less, vocab 100), no
# dropout, no cache. Each stands for a family users train: grouped-query and sliding-window
# decoders, parallel attention and MLP (GPT-NeoX, Phi, GPT-J, Falcon), ALiBi (Bloom), learned
# positions with a projection (OPT), encoders (DistilBERT, RoBERTa, DeBERTa-v2's disentangled
# relative attention, its mask filled with the dtype's lowest value), encoder-decoders (Bart, T5's
# relative position buckets, ModernBERT's alternating local and global attention), mixtures of
# experts (Mixtral, DeepSeek-V3's shared experts and latent attention: transformers' grouped
# expert matmuls), state-space and recurrent models (Mamba, its scan unrolled; Mamba-2's chunked
# scan; Jamba's mix of Mamba, attention and experts; RecurrentGemma's gated linear recurrence),
# Gemma 3's sliding-window layers, vision (ViT, Swin's shifted windows, ConvNeXt) and speech
# (Whisper's convolutional encoder and its decoder). ``inputs``: what :func:`hf_batch` makes for it.
_SMALL = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
HF_ARCHITECTURES = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(_SMALL, num_key_value_heads=2, max_position_embeddings=64),
              "tokens"),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(_SMALL, num_key_value_heads=2, max_position_embeddings=64),
                "tokens"),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(_SMALL, num_key_value_heads=1, head_dim=8,
                                                     max_position_embeddings=64), "tokens"),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(_SMALL, max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0),
            "tokens"),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(_SMALL, max_position_embeddings=64), "tokens"),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(vocab_size=100, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                                  n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                  bos_token_id=0, eos_token_id=0), "tokens"),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=4), "tokens"),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(vocab_size=100, hidden_size=32, n_layer=2, n_head=4), "tokens"),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(vocab_size=100, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=4, max_position_embeddings=64,
                                                word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                                                activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                                                eos_token_id=0), "tokens"),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig", dict(vocab_size=100, dim=32, hidden_dim=64, n_layers=2,
                                                                    n_heads=4, max_position_embeddings=64,
                                                                    dropout=0.0, attention_dropout=0.0), "tokens"),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", dict(_SMALL, max_position_embeddings=70, hidden_dropout_prob=0.0,
                                                           attention_probs_dropout_prob=0.0), "tokens"),
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(vocab_size=100, d_model=32, encoder_layers=1,
                                                               decoder_layers=1, encoder_attention_heads=4,
                                                               decoder_attention_heads=4, encoder_ffn_dim=64,
                                                               decoder_ffn_dim=64, max_position_embeddings=64,
                                                               dropout=0.0, attention_dropout=0.0,
                                                               activation_dropout=0.0, pad_token_id=1,
                                                               bos_token_id=0, eos_token_id=2,
                                                               decoder_start_token_id=2), "tokens"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(_SMALL, num_key_value_heads=2, num_local_experts=4,
                                                           num_experts_per_tok=2, max_position_embeddings=64),
                "tokens"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(_SMALL, num_key_value_heads=4, max_position_embeddings=64, n_routed_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                         topk_group=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
                         qk_nope_head_dim=4, v_head_dim=8), "tokens"),
    "deberta_v2": ("DebertaV2ForMaskedLM", "DebertaV2Config",
                   dict(_SMALL, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]), "tokens"),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                         num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                         pad_token_id=0), "tokens"),
    "mamba": ("MambaForCausalLM", "MambaConfig", dict(vocab_size=100, hidden_size=32, state_size=4,
                                                     num_hidden_layers=2), "tokens"),
    "mamba2": ("Mamba2ForCausalLM", "Mamba2Config", dict(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                        num_heads=4, head_dim=16, n_groups=1, state_size=8,
                                                        chunk_size=4, expand=2), "tokens"),
    "jamba": ("JambaForCausalLM", "JambaConfig", dict(_SMALL, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
                                                     attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                                     expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=2,
                                                     mamba_expand=2), "tokens"),
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig",
                        dict(_SMALL, num_key_value_heads=1, lru_width=32, attention_window_size=4,
                             block_types=["recurrent", "attention"]), "tokens"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(_SMALL, num_key_value_heads=2, head_dim=8,
                                                            max_position_embeddings=64, sliding_window=4), "tokens"),
    "modernbert": ("ModernBertForMaskedLM", "ModernBertConfig", dict(_SMALL, max_position_embeddings=64, pad_token_id=0,
                                                                    global_attn_every_n_layers=2, local_attention=4,
                                                                    embedding_dropout=0.0, mlp_dropout=0.0,
                                                                    attention_dropout=0.0), "tokens"),
    "vit": ("ViTForImageClassification", "ViTConfig", dict(image_size=16, patch_size=4, hidden_size=32,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          intermediate_size=64, num_labels=3,
                                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
            "image"),
    "swin": ("SwinForImageClassification", "SwinConfig", dict(image_size=16, patch_size=2, embed_dim=8, depths=[1, 1],
                                                             num_heads=[2, 2], window_size=4, num_labels=3,
                                                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                             drop_path_rate=0.0), "image"),
    "convnext": ("ConvNextForImageClassification", "ConvNextConfig", dict(hidden_sizes=[8, 16], depths=[1, 1],
                                                                         num_stages=2, num_labels=3, image_size=16,
                                                                         drop_path_rate=0.0), "image"),
    "whisper": ("WhisperForConditionalGeneration", "WhisperConfig",
                dict(vocab_size=100, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32,
                     max_source_positions=8, max_target_positions=16, dropout=0.0, pad_token_id=1, bos_token_id=0,
                     eos_token_id=2, decoder_start_token_id=0), "speech"),
}


def hf_batch(name: str, samples: int, generator: torch.Generator) -> dict:
    """A batch of ``samples`` for architecture ``name`` (:data:`HF_ARCHITECTURES`), drawn from
    ``generator``, with its labels, so that the model computes its own loss: token ids over the
    vocabulary but its two lowest ids (labels: the ids); images of 3 x 16 x 16 (labels: one of 3
    classes); or 8 mel bins x 16 frames of speech (labels: 6 token ids)."""
    kind = HF_ARCHITECTURES[name][3]
    if kind == "tokens":
        ids = torch.randint(2, 100, (samples, 8), generator=generator)
        return {"input_ids": ids, "labels": ids.clone()}
    if kind == "image":
        return {"pixel_values": torch.randn(samples, 3, 16, 16, generator=generator),
                "labels": torch.randint(0, 3, (samples,), generator=generator)}
    return {"input_features": torch.randn(samples, 8, 16, generator=generator),
            "labels": torch.randint(3, 100, (samples, 6), generator=generator)}


def hf_architecture(name: str, *, seed: int = 0, batch: int = 2):
    """One of :data:`HF_ARCHITECTURES`, randomly initialised from ``seed``, and an example of
    ``batch`` samples (:func:`hf_batch`)."""
    tf = _transformers()
    model_class, config_class, kwargs, _ = HF_ARCHITECTURES[name]
    torch.manual_seed(seed)
    config = getattr(tf, config_class)(**kwargs)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    model = getattr(tf, model_class)(config)
    return model, hf_batch(name, batch, torch.Generator().manual_seed(seed))
