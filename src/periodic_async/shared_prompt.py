"""Shared-prompt packing (PAPER.md point 6): one row [prompt | r_1 | ... | r_G] per group.

Shape letters: T packed tokens, N response (label) tokens, D hidden size, V vocabulary.

Layout guarantees:
- prompt tokens attend causally among themselves; response i attends to the whole prompt
  and to its own earlier tokens, never to a sibling response nor to another group;
- position ids are 0..P-1 on the prompt and restart at P for every response;
- the last prompt position predicts the first token of *each* response (its hidden state
  is gathered G times before the LM head); response tokens predict their successors;
  the last token of a response predicts nothing and is not fed as input.
With `shared=False` each sample is its own segment [prompt | r_i] (per-response packing),
the ablation baseline; both layouts produce the same flat label order, so the log-probs
of the two layouts are directly comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

Segment = tuple[Sequence[int], Sequence[Sequence[int]]]
"""(prompt ids, [response ids, ...]): one group, or part of one, to pack."""


@dataclass
class PackedBatch:
    input_ids_1xT: torch.Tensor
    """Packed input tokens."""
    position_ids_1xT: torch.Tensor
    """Position ids (restarting at P for each response in the shared layout)."""
    segment_T: torch.Tensor
    """Segment (document) id of each packed token; tokens of different segments never attend."""
    response_T: torch.Tensor
    """Response index within its segment, or -1 for prompt tokens."""
    pred_pos_N: torch.Tensor
    """Packed position whose hidden state predicts label n."""
    labels_N: torch.Tensor
    """Label token ids, in flat order: segment by segment, response by response, token by token."""
    sample_N: torch.Tensor
    """Flat sample index (0..S-1 over all responses of all segments) of each label."""
    num_samples: int
    """S: responses in the batch."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_1xT.shape[1])

    def to(self, device: torch.device | str) -> "PackedBatch":
        return PackedBatch(**{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in self.__dict__.items()})


def pack(segments: Sequence[Segment], shared: bool = True) -> PackedBatch:
    """Pack groups (or parts of groups) into one row; see the module docstring for the layout."""
    ids, pos, seg, resp, pred, labels, sample = [], [], [], [], [], [], []
    s_id = 0
    n_samples = 0
    for prompt, responses in segments:
        if len(prompt) == 0:
            raise ValueError("pack: empty prompt")
        P = len(prompt)
        for i, r in enumerate(responses):
            if len(r) == 0:
                raise ValueError(f"pack: empty response {i} of segment {s_id}")
            if i == 0 or not shared:
                if not shared and i > 0:
                    s_id += 1
                start = len(ids)
                ids.extend(prompt)
                pos.extend(range(P))
                seg.extend([s_id] * P)
                resp.extend([-1] * P)
                last_prompt = start + P - 1
            r_start = len(ids)
            body = list(r[:-1])  # the last token predicts nothing
            ids.extend(body)
            pos.extend(range(P, P + len(body)))
            seg.extend([s_id] * len(body))
            resp.extend([i if shared else -1] * len(body))
            pred.append(last_prompt)
            pred.extend(range(r_start, r_start + len(body)))
            labels.extend(r)
            sample.extend([n_samples] * len(r))
            n_samples += 1
        s_id += 1
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    seg_T, resp_T = as_long(seg), as_long(resp)
    return PackedBatch(
        input_ids_1xT=as_long(ids)[None], position_ids_1xT=as_long(pos)[None],
        segment_T=seg_T, response_T=resp_T,
        pred_pos_N=as_long(pred), labels_N=as_long(labels), sample_N=as_long(sample), num_samples=n_samples,
    )


def dense_mask(batch: PackedBatch) -> torch.Tensor:
    """Boolean 1x1xTxT mask (True = may attend) of the packed layout."""
    seg, resp = batch.segment_T, batch.response_T
    T = seg.shape[0]
    idx = torch.arange(T, device=seg.device)
    causal = idx[None, :] <= idx[:, None]
    same_seg = seg[None, :] == seg[:, None]
    visible = (resp[None, :] == -1) | (resp[None, :] == resp[:, None])
    return (causal & same_seg & visible)[None, None]


def token_logprobs(model, batch: PackedBatch, with_entropy: bool = False):
    """Per-label log-probs `logp_N` (and detached entropies `entropy_N`) of a HF causal LM."""
    hidden_1xTxD = model.base_model(
        input_ids=batch.input_ids_1xT, position_ids=batch.position_ids_1xT,
        attention_mask=dense_mask(batch), use_cache=False,
    ).last_hidden_state
    h_NxD = hidden_1xTxD[0, batch.pred_pos_N]
    logits_NxV = model.get_output_embeddings()(h_NxD)
    if logits_NxV.dtype in (torch.bfloat16, torch.float16):
        logits_NxV = logits_NxV.float()
    logprobs_NxV = torch.log_softmax(logits_NxV, dim=-1)
    logp_N = logprobs_NxV.gather(1, batch.labels_N[:, None])[:, 0]
    if not with_entropy:
        return logp_N
    with torch.no_grad():
        entropy_N = -(logprobs_NxV.exp() * logprobs_NxV).sum(-1)
    return logp_N, entropy_N
