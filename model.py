"""The models of CLIP4IDC, in plain PyTorch.

1. CLIP: OpenAI's ViT image encoder and causal text encoder, parameter for parameter (so OpenAI's weights load by name).
2. CLIP4IDC: the pair encoder of section 2.2 (intra layers per image, inter layers per pair) and the IP-T / T-IP
   contrastive loss of section 2.3, trained by adapt.py.
3. Captioner: the Transformer encoder-decoder of section 2.4 on top of the pair encoder, trained by caption.py.
"""
import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from cli import gather_batch, global_mean
from tokenizer import EOT, IGNORE, SOT, next_tokens, skip_padding, trim_padding

@dataclass
class CLIPConfig:  # defaults: ViT-B/32
    embed_dim: int = 512
    image_size: int = 224
    patch_size: int = 32
    vision_width: int = 768
    vision_layers: int = 12
    vision_heads: int = 12
    context_length: int = 77
    vocab_size: int = 49408
    text_width: int = 512
    text_layers: int = 12
    text_heads: int = 8
    activation: str = "quick_gelu"  # the MLPs' (ACTIVATIONS): OpenAI trained its CLIPs with QuickGELU, LAION with GELU


# The offline default's CLIP: small enough to train on a laptop CPU in minutes, with OpenAI's heads of 64.
SMALL_CLIP = CLIPConfig(embed_dim=64, image_size=128, patch_size=16, vision_width=64, vision_layers=4,
                        vision_heads=1, context_length=32, text_width=64, text_layers=2, text_heads=1)


# ---- CLIP ---------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Multi-head attention on SDPA under OpenAI's parameter names (in_proj_*, out_proj). `cache` keeps the keys and
    values of earlier decoding steps, so that decoding feeds one new token per step."""

    def __init__(self, width, heads, dropout=0.0):
        super().__init__()
        if heads < 1 or width % heads:
            raise ValueError(f"heads {heads}: expected a divisor of the width {width}")
        self.heads, self.dropout = heads, dropout
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))  # initialised by the owning model
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        self.keep_map, self.map = False, None  # keep_map: keep the attention weights in `self.map` (for figures)

    def forward(self, x, memory=None, causal=False, cache=None):
        cache = {} if cache is None else cache
        w, b, width = self.in_proj_weight, self.in_proj_bias, x.shape[-1]
        if memory is None:  # self-attention: new keys/values extend those of earlier steps
            q, k, v = F.linear(x, w, b).chunk(3, dim=-1)
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
        else:  # cross-attention to `memory`, whose keys/values are computed once
            q = F.linear(x, w[:width], b[:width])
            k, v = (cache["k"], cache["v"]) if "k" in cache else F.linear(memory, w[width:], b[width:]).chunk(2, dim=-1)
        cache["k"], cache["v"] = k, v
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        if self.keep_map:  # unmasked weights: only the vision tower's are ever drawn
            self.map = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1).detach()
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal)
        return self.out_proj(out.transpose(1, 2).flatten(2))


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)  # the GELU approximation CLIP was trained with


ACTIVATIONS = {"quick_gelu": QuickGELU, "gelu": nn.GELU}


class ResidualAttentionBlock(nn.Module):
    def __init__(self, width, heads, causal=False, activation="quick_gelu"):
        super().__init__()
        self.causal = causal
        self.attn = Attention(width, heads)
        self.ln_1 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(OrderedDict(c_fc=nn.Linear(width, 4 * width), gelu=ACTIVATIONS[activation](),
                                             c_proj=nn.Linear(4 * width, width)))
        self.ln_2 = nn.LayerNorm(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x), causal=self.causal)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, width, layers, heads, causal=False, activation="quick_gelu"):
        super().__init__()
        self.resblocks = nn.Sequential(*[ResidualAttentionBlock(width, heads, causal, activation) for _ in range(layers)])

    def forward(self, x):
        return self.resblocks(x)


class VisionTransformer(nn.Module):
    def __init__(self, c: CLIPConfig):
        super().__init__()
        scale, n_patches = c.vision_width ** -0.5, (c.image_size // c.patch_size) ** 2
        self.conv1 = nn.Conv2d(3, c.vision_width, c.patch_size, stride=c.patch_size, bias=False)
        self.class_embedding = nn.Parameter(scale * torch.randn(c.vision_width))
        self.positional_embedding = nn.Parameter(scale * torch.randn(n_patches + 1, c.vision_width))
        self.ln_pre = nn.LayerNorm(c.vision_width)
        self.transformer = Transformer(c.vision_width, c.vision_layers, c.vision_heads, activation=c.activation)
        self.ln_post = nn.LayerNorm(c.vision_width)
        self.proj = nn.Parameter(scale * torch.randn(c.vision_width, c.embed_dim))
        # CLIP's pre-training pixel statistics, not in the state dict: OpenAI's files load unchanged.
        self.register_buffer("mean", torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1), persistent=False)

    def embed(self, images):
        """Patchify, prepend the class token, add positions (Eq. 2-3): [B, n+1, width]. `images` are normalised floats,
        or uint8 pixels normalised here: batches then travel to the GPU at a quarter of the bytes."""
        if images.dtype == torch.uint8:
            images = (images.to(self.conv1.weight.dtype) / 255 - self.mean) / self.std
        # conv1 as one matrix product over the cut-out patches: GPUs run it many times faster than this convolution
        p = self.conv1.kernel_size[0]
        patches = images.unflatten(2, (-1, p)).unflatten(4, (-1, p)).permute(0, 2, 4, 1, 3, 5)  # [B, g, g, 3, p, p]
        x = F.linear(patches.flatten(3).flatten(1, 2), self.conv1.weight.flatten(1))
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        return self.ln_pre(torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype))

    def forward(self, images):
        x = self.transformer(self.embed(images))
        return self.ln_post(x[:, 0]) @ self.proj


class CLIP(nn.Module):
    def __init__(self, config: CLIPConfig):
        super().__init__()
        c = self.config = config
        self.visual = VisionTransformer(c)
        self.token_embedding = nn.Embedding(c.vocab_size, c.text_width)
        self.positional_embedding = nn.Parameter(torch.empty(c.context_length, c.text_width))
        self.transformer = Transformer(c.text_width, c.text_layers, c.text_heads, causal=True, activation=c.activation)
        self.ln_final = nn.LayerNorm(c.text_width)
        self.text_projection = nn.Parameter(torch.empty(c.text_width, c.embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.initialize_parameters()

    def initialize_parameters(self):
        """OpenAI's initialisation, applied to both towers (it matters only for training from scratch)."""
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        nn.init.normal_(self.text_projection, std=self.config.text_width ** -0.5)
        for tower in (self.visual.transformer, self.transformer):
            width = tower.resblocks[0].ln_1.normalized_shape[0]
            proj_std = width ** -0.5 * (2 * len(tower.resblocks)) ** -0.5
            for block in tower.resblocks:
                nn.init.normal_(block.attn.in_proj_weight, std=width ** -0.5)
                nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
                nn.init.normal_(block.mlp.c_fc.weight, std=(2 * width) ** -0.5)
                nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)

    def encode_image(self, images):
        return self.visual(images)

    def encode_text(self, tokens):
        """G(T) of Eq. 1: tokens [B, L] with L <= context_length; the EOT token (the largest id) pools the sentence."""
        tokens = trim_padding(tokens)  # attention is causal: padding never reaches an EOT
        x = self.token_embedding(tokens) + self.positional_embedding[:tokens.shape[1]]
        x = self.ln_final(self.transformer(x))
        return x[torch.arange(x.shape[0], device=x.device), tokens.argmax(dim=-1)] @ self.text_projection

    def forward(self, images, tokens):
        image_features = F.normalize(self.encode_image(images), dim=-1)
        text_features = F.normalize(self.encode_text(tokens), dim=-1)
        logits_per_image = self.logit_scale.exp() * image_features @ text_features.t()
        return logits_per_image, logits_per_image.t()


# ---- CLIP4IDC: the pair encoder (section 2.2) and the IP-T / T-IP adaptation loss (section 2.3)
@dataclass
class CLIP4IDCConfig:
    clip: CLIPConfig = field(default_factory=CLIPConfig)
    n_intra: int = 9  # N_intra: layers that see one image; the other N_inter see the pair (Table 7)
    context_length: int = 32  # caption length in tokens, SOT and EOT included (Appendix B)
    average_directions: bool = False  # Eq. 8 sums IP-T and T-IP; the authors' code averages them

    @property
    def n_inter(self):
        return self.clip.vision_layers - self.n_intra


class CLIP4IDC(nn.Module):
    def __init__(self, config: CLIP4IDCConfig, clip: CLIP = None):
        super().__init__()
        if not 0 <= config.n_intra <= config.clip.vision_layers:
            raise ValueError(f"n_intra={config.n_intra} must lie in 0..{config.clip.vision_layers} (the vision layers)")
        if config.context_length > config.clip.context_length:
            raise ValueError(f"context_length={config.context_length} exceeds CLIP's {config.clip.context_length}")
        self.config = config
        self.clip = clip if clip is not None else CLIP(config.clip)
        width, scale = config.clip.vision_width, config.clip.vision_width ** -0.5
        n_tokens = self.clip.visual.positional_embedding.shape[0]  # n + 1
        self.e1 = nn.Parameter(scale * torch.randn(width))  # marks the first image (Eq. 4)
        self.e2 = nn.Parameter(scale * torch.randn(width))  # marks the second image
        self.pair_pos = nn.Parameter(scale * torch.randn(2 * n_tokens, width))  # p in Eq. 4
        self.ln_inter = nn.LayerNorm(width)  # not in Eq. 4: the authors' code normalises the joined tokens

    def new_parameter_names(self):
        """Parameters that CLIP does not have: they train at the higher learning rate."""
        return {name for name, _ in self.named_parameters() if not name.startswith("clip.")}

    def encode_pair(self, before, after):
        """F'(X1, X2): Eq. 4, then the projection W, on all 2(n+1) tokens: [B, 2(n+1), embed_dim]. `after` may hold k
        images for each before image, [B, k, 3, H, W] (stage 2's change and distractor pairs share their before
        image): the before image then passes the intra layers once, and the result has B * k rows."""
        visual, n_intra = self.clip.visual, self.config.n_intra
        x = visual.embed(torch.cat([before, after.flatten(0, -4)]))  # Eq. 2-3, all images in one batch
        for block in visual.transformer.resblocks[:n_intra]:  # the intra layers: each image on its own
            x = block(x)
        x1, x2 = x[:len(before)].repeat_interleave(after.shape[1] if after.ndim == 5 else 1, dim=0), x[len(before):]
        # Eq. 4: e1 / e2 mark the images, p is the pair position embedding; the inter layers see both images
        x = self.ln_inter(torch.cat([x1 + self.e1, x2 + self.e2], dim=1) + self.pair_pos)
        for block in visual.transformer.resblocks[n_intra:]:
            x = block(x)
        return visual.ln_post(x) @ visual.proj

    @staticmethod
    def pool(tokens):
        """Eq. 5: v, the mean of the two class tokens' outputs (the paper's positions 1 and n+2, 0-based 0 and n+1)."""
        return (tokens[:, 0] + tokens[:, tokens.shape[1] // 2]) / 2

    def encode_text(self, tokens):
        """g in Eq. 1: CLIP's text encoder, read at the EOT token."""
        return self.clip.encode_text(tokens)

    def forward(self, before, after, tokens, negatives=None):
        """The adaptation loss L of Eq. 8 for a batch of B aligned (pair, caption) samples; `negatives` [B, N, L]:
        each pair's hard-negative captions (adapt.HardNegatives), extra IP-T columns."""
        v = self.pool(self.encode_pair(before, after))
        if negatives is None:
            g, h = self.encode_text(tokens), None
        else:  # hard negatives make the captions many, and the padding to the longest most of their cost
            texts = torch.cat([tokens, negatives.flatten(0, 1)])
            if skip_padding(texts):  # so: 4 groups of captions of like length, each cut after its own longest
                order = (texts == EOT).int().argmax(dim=1).argsort()
                texts = torch.cat([self.encode_text(texts[rows]) for rows in order.chunk(4)])[order.argsort()]
            else:
                texts = self.encode_text(texts)
            g, h = texts[:len(tokens)], texts[len(tokens):].unflatten(0, negatives.shape[:2])
        loss = contrastive_loss(v, g, self.clip.logit_scale, h)
        return loss / 2 if self.config.average_directions else loss


def contrastive_loss(v, g, logit_scale, h=None):
    """Eq. 6-8: cross-entropy over the B x B cosine similarities s(v, g) / tau, both directions, B the global batch
    (all processes' pairs and captions). h [B, N, D]: each pair's N hard-negative captions, N more columns of its own
    in IP-T (IDC-PCL's FDA, beyond the paper); T-IP stays B x B."""
    v, g = gather_batch(v), gather_batch(g)
    with torch.autocast(v.device.type, enabled=False):  # logits near 1/tau = 100 need fp32, not bf16
        v = logit_scale.exp() * F.normalize(v.float(), dim=-1)
        logits = v @ F.normalize(g.float(), dim=-1).t()
        if h is not None:
            hard = F.normalize(gather_batch(h).float(), dim=-1) @ v[:, :, None]  # [B, N, 1]
    labels = torch.arange(len(logits), device=logits.device)
    loss_i2t = F.cross_entropy(logits if h is None else torch.cat([logits, hard[:, :, 0]], 1), labels)  # IP-T, Eq. 6
    loss_t2i = F.cross_entropy(logits.t(), labels)  # T-IP, Eq. 7
    return loss_i2t + loss_t2i  # Eq. 8 sums the two (the authors' code averages them)


# ---- Captioner: a Transformer encoder-decoder on the pair encoder's tokens (section 2.4) --------
@dataclass
class CaptionerConfig:  # Appendix B: 3 + 3 layers, 8 heads, hidden 512 (= CLIP's embed_dim), dropout 0.1
    layers: int = 3
    heads: int = 8
    ffn: int = 2048
    dropout: float = 0.1
    attn_dropout: float = 0.1  # on the attention weights
    max_len: int = 33  # SOT, then at most 32 greedy steps (Appendix B), as in the authors' code
    vocab: tuple = ()  # the token ids it may write, EOT among them (empty: all of CLIP's)
    ln_eps: float = 1e-12  # the LayerNorms' epsilon, as in the authors' BERT-style layers (PyTorch's default: 1e-5)


class EncoderLayer(nn.Module):
    """A post-LN Transformer layer, as in the BERT-style captioner of the authors' code."""

    def __init__(self, width, c: CaptionerConfig):
        super().__init__()
        self.attn, self.ln_1 = Attention(width, c.heads, c.attn_dropout), nn.LayerNorm(width, c.ln_eps)
        self.mlp = nn.Sequential(nn.Linear(width, c.ffn), nn.GELU(), nn.Linear(c.ffn, width))
        self.ln_2 = nn.LayerNorm(width, c.ln_eps)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        x = self.ln_1(x + self.drop(self.attn(x)))
        return self.ln_2(x + self.drop(self.mlp(x)))


class DecoderLayer(nn.Module):
    def __init__(self, width, c: CaptionerConfig):
        super().__init__()
        self.self_attn, self.ln_1 = Attention(width, c.heads, c.attn_dropout), nn.LayerNorm(width, c.ln_eps)
        self.cross_attn, self.ln_2 = Attention(width, c.heads, c.attn_dropout), nn.LayerNorm(width, c.ln_eps)
        self.mlp = nn.Sequential(nn.Linear(width, c.ffn), nn.GELU(), nn.Linear(c.ffn, width))
        self.ln_3 = nn.LayerNorm(width, c.ln_eps)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, y, memory, cache=None):
        self_cache, cross_cache = (cache["self"], cache["cross"]) if cache is not None else (None, None)
        # With a cache, decoding feeds one new token, which may see every cached one: no mask.
        y = self.ln_1(y + self.drop(self.self_attn(y, causal=cache is None, cache=self_cache)))
        y = self.ln_2(y + self.drop(self.cross_attn(y, memory=memory, cache=cross_cache)))
        return self.ln_3(y + self.drop(self.mlp(y)))


class WordCrossEntropy(torch.autograd.Function):
    """F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum") in fp32, whose backward turns the saved
    log-probabilities into the gradient in place instead of writing two more buffers of [tokens, 49,408 words]: on a
    CPU a fresh buffer that size (about 80 MB) costs as much in page faults as the arithmetic on it."""

    @staticmethod
    def forward(ctx, logits, targets):
        logp, keep = torch.log_softmax(logits.float(), dim=-1), targets != IGNORE
        targets = targets.clamp(min=0)[:, None]
        ctx.save_for_backward(logp, targets, keep)
        ctx.dtype = logits.dtype
        return -(logp.gather(1, targets)[:, 0] * keep).sum()

    @staticmethod
    def backward(ctx, grad):
        logp, targets, keep = ctx.saved_tensors
        probs = logp.exp_().scatter_add_(1, targets, torch.full_like(targets, -1, dtype=logp.dtype))
        return probs.mul_(grad * keep[:, None]).to(ctx.dtype), None  # softmax - one-hot, per real token


class Captioner(nn.Module):
    def __init__(self, encoder: CLIP4IDC, config: CaptionerConfig = None):
        super().__init__()
        c = self.config = config or CaptionerConfig()
        clip_config = encoder.config.clip
        if clip_config.text_width != clip_config.embed_dim:
            raise ValueError("the captioner reads projected visual tokens with CLIP's word embeddings: "
                             f"text_width ({clip_config.text_width}) must equal embed_dim ({clip_config.embed_dim})")
        if c.max_len - 1 > clip_config.context_length:  # the last token is only ever predicted
            raise ValueError(f"max_len {c.max_len}: expected at most {clip_config.context_length + 1}, "
                             f"CLIP's {clip_config.context_length} text positions + 1")
        width = clip_config.embed_dim
        self.encoder = encoder  # the (adapted) pair encoder; its text tower lends the word embeddings
        for name, p in encoder.clip.named_parameters():
            if not name.startswith("visual.") and name not in ("token_embedding.weight", "positional_embedding"):
                p.requires_grad_(False)  # the rest of CLIP's text tower plays no part in captioning
        self.ln_embed, self.drop = nn.LayerNorm(width, c.ln_eps), nn.Dropout(c.dropout)
        self.enc_layers = nn.ModuleList([EncoderLayer(width, c) for _ in range(c.layers)])
        self.dec_layers = nn.ModuleList([DecoderLayer(width, c) for _ in range(c.layers)])
        # The prediction head of the authors' BERT-style decoder, before the tied word embeddings.
        self.head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width, c.ln_eps))
        self.head_bias = nn.Parameter(torch.zeros(clip_config.vocab_size))
        self.write_only(c.vocab)
        for attn in (m for m in [*self.enc_layers.modules(), *self.dec_layers.modules()] if isinstance(m, Attention)):
            nn.init.xavier_uniform_(attn.in_proj_weight)

    def write_only(self, words):
        """Score and write only the token ids `words`, EOT among them (all of CLIP's for ())."""
        words, n = sorted(words), self.head_bias.shape[0]
        # A checkpoint's list: an id past CLIP's would fail, a negative one write another word, no EOT never end
        if words and (words[0] < 0 or words[-1] >= n or EOT not in words):
            raise ValueError(f"vocab: expected token ids in 0..{n - 1}, EOT ({EOT}) among them; "
                             f"got {len(words)} ids from {words[0]} to {words[-1]}")
        self.config = replace(self.config, vocab=tuple(words))
        self.register_buffer("words", self.head_bias.new_tensor(self.config.vocab, dtype=torch.long), persistent=False)

    def new_parameter_names(self):
        """The captioning model, learned at the higher rate (Appendix B). CLIP's word and position embeddings count as
        its own: here they are the captioner's input and output layer."""
        word = {"encoder.clip.token_embedding.weight", "encoder.clip.positional_embedding"}
        return {name for name, _ in self.named_parameters() if not name.startswith("encoder.") or name in word}

    def visual_memory(self, before, after):
        return self.encode_visual(self.encoder.encode_pair(before, after))

    def encode_visual(self, x):
        memories = []  # decoder layer i attends to the output of encoder layer i
        for layer in self.enc_layers:
            x = layer(x)
            memories.append(x)
        return memories

    def decode(self, ids, memories, caches=None, start=0):
        clip = self.encoder.clip
        y = clip.token_embedding(ids) + clip.positional_embedding[start:start + ids.shape[1]]
        y = self.drop(self.ln_embed(y))
        for i, layer in enumerate(self.dec_layers):
            y = layer(y, memories[i], caches[i] if caches is not None else None)
        return y

    def logits(self, y):
        weight, bias = self.encoder.clip.token_embedding.weight, self.head_bias  # tied to the input's
        if self.config.vocab:  # only config.vocab's columns, in increasing order
            weight, bias = weight[self.words], bias[self.words]
        return F.linear(self.head(y), weight, bias)

    def columns(self, targets):
        """Each target id's column of the logits; IGNORE for a word it cannot write (and for IGNORE)."""
        if not self.config.vocab:
            return targets
        column = torch.searchsorted(self.words, targets).clamp(max=len(self.words) - 1)
        return column.masked_fill(self.words[column] != targets, IGNORE)

    def forward(self, before, after, ids):
        """The word-level cross-entropy of captions `ids` (SOT ... EOT, zero padding that does not count), by teacher
        forcing: the state at position t predicts ids[:, t + 1]. ids [B, L], or [B, k, L] for k after images each."""
        ids = trim_padding(ids.flatten(0, -2))
        y = self.decode(ids[:, :-1], self.visual_memory(before, after))
        targets = self.columns(next_tokens(ids))
        real = targets != IGNORE
        if skip_padding(y):  # the vocabulary projection is the costliest layer: spare it the padding
            y, targets = y[real], targets[real]
        loss = WordCrossEntropy.apply(self.logits(y).flatten(0, -2), targets.flatten())
        return global_mean(loss, real.sum())

    @torch.no_grad()
    def generate(self, before, after, max_len=None, use_cache=True, beam=1, length_penalty=1.0, return_scores=False):
        """Captions [B, <= max_len]: ids from SOT, each row zero-padded after its EOT, by greedy decoding (beam 1) or
        beam search; return_scores: also their scores [B] as beam search scores them (greedy's by teacher forcing)."""
        if beam < 1 or not length_penalty >= 0 or not (use_cache or beam == 1):
            raise ValueError(f"beam {beam}, length_penalty {length_penalty}, use_cache {use_cache}: expected a beam of "
                             "at least 1, a length_penalty of at least 0, and the cache for a beam above 1")
        memories = self.visual_memory(before, after)
        if beam > 1:
            ids, scores = self.beam_search(memories, beam, max_len, length_penalty)
            return (ids, scores) if return_scores else ids
        ids = self.greedy(memories, max_len, use_cache)
        if not return_scores:
            return ids
        targets = self.columns(next_tokens(ids))
        logp = self.logits(self.decode(ids[:, :-1], memories)).float().log_softmax(-1)
        real = targets != IGNORE
        logp = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0].where(real, 0)
        return ids, logp.sum(1) / real.sum(1) ** length_penalty

    @torch.no_grad()
    def greedy(self, memories, max_len=None, use_cache=True):
        max_len, batch, device = max_len or self.config.max_len, memories[0].shape[0], memories[0].device
        ids = torch.full((batch, 1), SOT, dtype=torch.long, device=device)
        caches = [{"self": {}, "cross": {}} for _ in self.dec_layers] if use_cache else None
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        for step in range(max_len - 1):
            y = self.decode(ids[:, -1:], memories, caches, start=step) if use_cache else self.decode(ids, memories)
            token = self.logits(y[:, -1]).argmax(dim=-1)
            token = (self.words[token] if self.config.vocab else token).masked_fill(done, 0)
            ids = torch.cat([ids, token[:, None]], dim=1)
            done |= token == EOT
            if done.all():
                break
        return ids

    @torch.no_grad()
    def beam_search(self, memories, beam, max_len=None, length_penalty=1.0):
        """Each pair keeps its `beam` likeliest unfinished captions (by their sum of log-probabilities) and the finished
        one (at EOT) of the best score, sum / length ** length_penalty, the length being the tokens written after SOT,
        EOT included (the length normalisation of Wu et al. 2016, as length ** alpha for their ((5 + length) / 6) **
        alpha). If none ends within max_len - 1 steps, the unfinished one of the best score. Returns (ids, scores)."""
        max_len, batch, device = max_len or self.config.max_len, memories[0].shape[0], memories[0].device
        eot = int(torch.searchsorted(self.words, EOT)) if self.config.vocab else EOT  # its column of the logits
        pairs = torch.arange(batch, device=device)[:, None]
        ids = torch.full((batch, 1), SOT, dtype=torch.long, device=device)  # a row a pair; after the first step, a beam
        caches = [{"self": {}, "cross": {}} for _ in self.dec_layers]
        alive = torch.zeros(batch, 1, device=device)  # the unfinished captions' sums
        best, best_ids = torch.full((batch,), -math.inf, device=device), F.pad(ids, (0, max_len - 1))
        for step in range(max_len - 1):
            logits = self.logits(self.decode(ids[:, -1:], memories, caches, start=step)[:, -1])
            total = alive[..., None] + logits.float().log_softmax(-1).view(batch, alive.shape[1], -1)
            score, which = (total[..., eot] / (step + 1) ** length_penalty).max(1)  # the best caption ending here
            ended = torch.cat([ids.view(batch, alive.shape[1], -1)[pairs[:, 0], which], torch.full_like(pairs, EOT)], 1)
            best_ids[:, :step + 2] = torch.where((score > best)[:, None], ended, best_ids[:, :step + 2])
            best = best.maximum(score)
            total[..., eot] = -math.inf  # the beams go on without it
            alive, index = total.flatten(1).topk(min(beam, total[0].numel()))
            origin = (index // total.shape[-1] + total.shape[1] * pairs).flatten()
            # Each beam takes the keys/values of the beam it extends; those of the memory, alike for a pair's beams
            # (computed once, at the first step), only where a pair has more beams than before
            grown = index.shape[1] != total.shape[1]
            for cache in caches:
                for part in ("self", "cross") if grown else ("self",):
                    cache[part] = {kv: t[origin] for kv, t in cache[part].items()}
            token = index.flatten() % total.shape[-1]
            ids = torch.cat([ids[origin], (self.words[token] if self.config.vocab else token)[:, None]], dim=1)
            # An exact stop: a sum (<= 0) only falls with more tokens, so no score beats sum / (max_len - 1) ** penalty
            if (best >= alive[:, 0] / (max_len - 1) ** length_penalty).all():
                break
        if (unfinished := best == -math.inf).any():  # so the loop ran all steps: ids hold full-length beams, best first
            best_ids = torch.where(unfinished[:, None], ids.view(batch, -1, max_len)[:, 0], best_ids)
            return best_ids, torch.where(unfinished, alive[:, 0] / (max_len - 1) ** length_penalty, best)
        return best_ids[:, :int((best_ids == EOT).int().argmax(1).max()) + 1], best
