"""Attention back-ends of shared-prompt packing (`shared_prompt.py` packs and selects; this runs).

split: exact work, no TxT mask. Per segment one causal attention over the contiguous
[prompt | r_1]; every further response attends to [prompt K/V ; own K/V] (lower-right
causal). On CPU the sibling responses r_2..r_G go as one flash attention of all their
queries against the prompt plus one small causal call per response, merged by log-sum-exp
(`_PromptPlusOwn`); elsewhere one masked SDPA call per response. It is registered with
transformers' `AttentionInterface` as "shared_prompt": the model code is untouched, and a
model switched to it behaves exactly as SDPA in every call that carries no `SplitPlan`
(generate, plain forwards). A per-response packing is one causal call per row: varlen.

flex: FlexAttention (transformers' integration, compiled) with a BlockMask built from the
same predicate as the dense mask: block-sparse on CUDA.

Shapes: T packed tokens, H query heads, H_kv key/value heads, d head size, L response inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "shared_prompt"
"""Name of our attention function in transformers' AttentionInterface."""


@dataclass
class SplitPlan:
    """The attention calls of one packed row, in token order; shared by every layer of a forward.

    A call (q0, q1, p0, p1) lets queries q0..q1-1 attend to keys [p0..p1-1 ; q0..q1-1]:
    all of the prompt p0..p1 and, causally, themselves. p0 == p1 is a plain causal call
    (a segment's prompt with its first response, or a whole per-response row).
    """

    calls: list[tuple[int, int, int, int]]
    block_mask: object = None
    """A FlexAttention BlockMask: when set, the flex back-end runs instead of the calls."""
    _masks: dict = field(default_factory=dict)

    def response_mask(self, P: int, L: int, device: torch.device) -> torch.Tensor:
        """Bool LxP+L: every prompt key, then own keys causally (lower-right aligned)."""
        if (P, L) not in self._masks:
            m = torch.ones(L, P + L, dtype=torch.bool, device=device)
            m[:, P:] = torch.ones(L, L, dtype=torch.bool, device=device).tril()
            self._masks[P, L] = m
        return self._masks[P, L]


def split_plan(segment_T: torch.Tensor, response_T: torch.Tensor) -> SplitPlan:
    """Derive the attention calls from the segment / response ids of a packed row (`PackedBatch`).

    Requires what `shared_prompt.pack` guarantees: segments contiguous, each starting with one
    prompt run (response -1), followed by contiguous responses; raises ValueError otherwise.
    """
    seg, resp = segment_T, response_T
    starts = torch.cat([torch.zeros(1, dtype=torch.long, device=seg.device),
                        1 + torch.nonzero((seg[1:] != seg[:-1]) | (resp[1:] != resp[:-1]))[:, 0]])
    counts = torch.diff(starts, append=torch.tensor([seg.shape[0]], device=seg.device))
    runs = torch.stack([seg[starts], resp[starts]])  # 2 x runs: (segment, response) of each run
    calls: list[list[int]] = []
    seen_segments: set[int] = set()
    pos, prompt, after_prompt, seen_resp, current = 0, (0, 0), False, set(), -1
    for (s, r), n in zip(runs.t().tolist(), counts.tolist()):
        if r < 0:
            if s in seen_segments:
                raise ValueError(f"split_plan: segment {s} is not contiguous or has two prompt runs")
            seen_segments.add(s)
            prompt, after_prompt, seen_resp = (pos, pos + n), True, set()
            calls.append([pos, pos + n, pos, pos])
        else:
            if not calls or s not in seen_segments or s != current or r in seen_resp:
                raise ValueError(f"split_plan: response {r} of segment {s} has no prompt before it "
                                 "or is not contiguous")
            seen_resp.add(r)
            if after_prompt:  # [prompt | r_first] is contiguous: one causal call
                calls[-1][1] += n
            else:
                calls.append([pos, pos + n, *prompt])
            after_prompt = False
        current = s
        pos += n
    return SplitPlan(calls=[tuple(c) for c in calls])


MERGE_SIBLINGS_ON_CPU = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
"""Use `_PromptPlusOwn` on CPU: its fwd+bwd measured faster than one call per response when it was
written (a timing no results CSV keeps; False to compare, e.g. under experiments/shared_prompt_ablation.py)."""


def _merge_siblings(calls):
    """Adjacent response calls on the same prompt -> one call (q0, q1, p0, p1, [L_i, ...])."""
    out = []
    for q0, q1, p0, p1 in calls:
        if p0 == p1:  # causal call: unchanged
            out.append((q0, q1, p0, p1))
        elif out and len(out[-1]) == 5 and out[-1][2:4] == (p0, p1) and out[-1][1] == q0:
            out[-1] = (out[-1][0], q1, p0, p1, out[-1][4] + [q1 - q0])
        else:
            out.append((q0, q1, p0, p1, [q1 - q0]))
    return out


_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _PromptPlusOwn(torch.autograd.Function):
    """CPU: the queries of several sibling responses (contiguous, lengths L_i) against
    [prompt K/V ; own K/V causally], as two flash attentions merged by log-sum-exp: one call of
    all queries against the prompt (no mask) and one causal call per response. The backward of
    each part with the merged output and log-sum-exp is the exact gradient (as in ring attention)."""

    @staticmethod
    def forward(ctx, q, k_p, v_p, k, v, lengths, scale):
        o1, lse1 = _flash(q, k_p, v_p, scale=scale)
        parts, starts = [], [0]
        for n in lengths:
            starts.append(starts[-1] + n)
            parts.append(_flash(q[:, :, starts[-2]:starts[-1]], k[:, :, starts[-2]:starts[-1]],
                                v[:, :, starts[-2]:starts[-1]], is_causal=True, scale=scale))
        o2, lse2 = torch.cat([o for o, _ in parts], 2), torch.cat([lse_i for _, lse_i in parts], 2)
        lse = torch.logaddexp(lse1, lse2)
        out = (o1 * (lse1 - lse).exp()[..., None] + o2 * (lse2 - lse).exp()[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k_p, v_p, k, v, out, lse)
        ctx.starts, ctx.scale = starts, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_p, v_p, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.to(q.dtype).contiguous()
        dq, dk_p, dv_p = _flash_backward(grad_out, q, k_p, v_p, out, lse, 0.0, False, scale=ctx.scale)
        dq2, dk, dv = [], [], []
        for a, b in zip(ctx.starts[:-1], ctx.starts[1:]):
            g = _flash_backward(grad_out[:, :, a:b], q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], out[:, :, a:b],
                                lse[:, :, a:b], 0.0, True, scale=ctx.scale)
            dq2.append(g[0])
            dk.append(g[1])
            dv.append(g[2])
        return dq + torch.cat(dq2, 2), dk_p, dv_p, torch.cat(dk, 2), torch.cat(dv, 2), None, None


def split_attention(query, key, value, plan: SplitPlan, scaling: float | None = None, dropout: float = 0.0):
    """Attention of a packed row, call by call. query 1xHxTxd, key/value 1xH_kvxTxd -> 1xTxHxd."""
    if query.shape[0] != 1:
        raise ValueError(f"split attention expects one packed row, got batch {query.shape[0]}")
    if torch.is_autocast_enabled(query.device.type):  # mixed precision: RoPE left q, k in float32,
        dt = torch.get_autocast_dtype(query.device.type)  # and the raw kernels below want one dtype
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    gqa = {}
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        if query.device.type == "cpu":  # CPU SDPA takes GQA with a mask; CUDA kernels would fall to math
            gqa = dict(enable_gqa=True)
        else:
            key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    outs = []
    calls = plan.calls
    if MERGE_SIBLINGS_ON_CPU and query.device.type == "cpu" and dropout == 0.0:
        calls = _merge_siblings(calls)
    for q0, q1, p0, p1, *lengths in calls:
        q = query[:, :, q0:q1]
        if lengths:
            outs.append(_PromptPlusOwn.apply(q, key[:, :, p0:p1], value[:, :, p0:p1], key[:, :, q0:q1],
                                             value[:, :, q0:q1], lengths[0], scaling))
        elif p0 == p1:
            outs.append(F.scaled_dot_product_attention(q, key[:, :, q0:q1], value[:, :, q0:q1], is_causal=True,
                                                       dropout_p=dropout, scale=scaling, **gqa))
        else:
            k = torch.cat([key[:, :, p0:p1], key[:, :, q0:q1]], dim=2)
            v = torch.cat([value[:, :, p0:p1], value[:, :, q0:q1]], dim=2)
            mask = plan.response_mask(p1 - p0, q1 - q0, query.device)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                       **gqa))
    out = torch.cat(outs, dim=2)
    if out.shape[2] != query.shape[2]:
        raise ValueError(f"split attention covered {out.shape[2]} of {query.shape[2]} tokens")
    return out.transpose(1, 2).contiguous()


def shared_prompt_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            shared_prompt_plan: SplitPlan | None = None, **kwargs):
    """transformers attention function "shared_prompt". Without a plan (generate, plain forwards)
    it is exactly transformers' SDPA, so switching a model to it changes nothing else."""
    if shared_prompt_plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    for name in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"shared-prompt attention does not support {name} ({type(module).__name__})")
    if shared_prompt_plan.block_mask is not None:
        from transformers.integrations.flex_attention import flex_attention_forward

        return flex_attention_forward(module, query, key, value, shared_prompt_plan.block_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    return split_attention(query, key, value, shared_prompt_plan, scaling, dropout), None


AttentionInterface.register(ATTN_IMPLEMENTATION, shared_prompt_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)  # plain calls get SDPA's masks


def flex_block_mask(segment_T: torch.Tensor, response_T: torch.Tensor):
    """FlexAttention BlockMask of a packed row (the predicate of `shared_prompt.dense_mask`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    seg, resp = segment_T, response_T

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (seg[q] == seg[kv]) & ((resp[kv] < 0) | (resp[kv] == resp[q]))

    T = seg.shape[0]
    return create_block_mask(mask_mod, None, None, T, T, device=seg.device, _compile=seg.device.type == "cuda")
