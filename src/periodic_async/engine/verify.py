"""Proof that a weight push arrived: the engines' log-probs of a fixed probe sequence against
the trainer's, after the barrier's push (`engine.verify_push`).

The paper's on-policy claim rests on the barrier: every sample of iteration t comes from the
weights of version t. A push that silently keeps part of the old weights breaks it without any
error, and it happens: on vLLM's CPU build a tied embedding sent under one of its two names
changes the input embedding but not the LM head. So after each push (or only the first,
or never) `PushCheck.after_push`

    trainer  scores the probe: log_softmax(policy(probe).logits)[i, probe[i+1]] (temperature 1),
             L-1 log-probs of a fixed sequence of L tokens (`probe_tokens`: seeded, spread over
             the vocabulary, so every embedding row it touches and the whole LM head count);
    engines  score the same tokens (`Engine.probe_logprobs`: vLLM's prompt log-probs, or a
             forward of the worker's model), one array per worker;
    check    the largest |gap| of each worker must be <= `engine.verify_atol`, else an
             EngineError names the worker, the version and the gap.

Every check is logged (logger.info: version, push seconds, the largest gap and its worker)
and kept in `last` for the iteration's metrics. What it proves and what not: a gap above the
tolerance means the engine does not hold the trainer's weights; a gap below it means its
outputs agree with them on the probe to that tolerance. In fp32 through vLLM's CPU build a
push that arrived leaves gaps well below the default tolerance and one that did not (a
half-updated tied embedding, a moved policy never sent) gaps far above it (`probe_max_gap` and
`gap_without_push` in results/vllm_push.csv; tests/test_vllm.py, tests/test_verify.py). A push
that changes the weights by less than the tolerance cannot be told from a push that did not
arrive. The built-in engines copy weights exactly (gap ~1e-7).

LoRA (model.lora.enabled): the push is the adapter alone, and both sides score through it. The
trainer's policy is a peft model, whose forward applies its adapter; the engines' probes run
through the adapter they were pushed (the built-in engines' peft model, vLLM's LoRA request of
the version), or through the merged weights (model.lora.push='merged': plain engines, a copy
loads the merged state dict as for full fine-tuning). A stale adapter, one missing a tensor
that was never loaded, or a base that is not the trainer's shows as a gap like any push that
did not arrive (tests/test_lora_engines.py).
With `copy` the reference is the base built from the config (as the trainer built it) with the
same adapters, loaded with each pushed adapter.

Half precision (`model.dtype` bfloat16/float16): the engines hold the pushed half weights and
compute in half, while the trainer keeps float32 masters. Half rounding alone moves a trained
model's probe log-probs by more than any useful tolerance (measured on an H200 with a trained
LM's logit spread: docs/gpu.md, results/gpu/correctness.csv), so the
reference is a half copy of the pushed weights, scored in half: the engines' own arithmetic
(the built-in engines then agree exactly). Its cost is one half-precision copy of the model on
the trainer's device.

Engines that cannot be probed return None and are skipped (logged once).
"""

from __future__ import annotations

import logging
import time
from typing import get_args

import numpy as np
import torch

from periodic_async.config import HalfDType, VerifyPush
from periodic_async.engine.base import Engine, EngineError
from periodic_async.lora import is_lora, load_adapter
from periodic_async.model import eval_mode

logger = logging.getLogger(__name__)

PROBE_LENGTH = 48
"""Tokens of the probe sequence (47 log-probs)."""


def probe_tokens(vocab_size: int, length: int = PROBE_LENGTH, seed: int = 20251124) -> list[int]:
    """The fixed probe: `length` token ids drawn uniformly from [0, vocab_size), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


@torch.no_grad()
def model_logprobs(model: torch.nn.Module, token_ids: list[int]) -> np.ndarray:
    """log_softmax(model(token_ids).logits / 1)[i, token_ids[i+1]] for i < L-1, in float64 numpy
    (L-1 values). The model is in eval mode for the forward (`model.eval_mode`)."""
    with eval_mode(model):
        device = next(model.parameters()).device
        ids = torch.tensor([token_ids], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return lp.double().cpu().numpy()


def default_atol(dtype: str) -> float:
    """`engine.verify_atol` when unset: 1e-3 in float32/float64, 0.1 in half precision."""
    return 0.1 if dtype in get_args(HalfDType) else 1e-3


class PushCheck:
    """After-push comparison of engine and trainer log-probs on `token_ids` (see the module
    docstring). `reference` is the trainer's model, whose weights are the pushed ones; with
    `copy` it is a stand-alone copy that loads the pushed state dict before each check (FSDP
    trainer ranks: the policy's forward would be a collective of all ranks); with LoRA, the
    pushed adapter into a copy of the base with the same adapters."""

    def __init__(self, reference: torch.nn.Module, token_ids: list[int], atol: float, when: VerifyPush = "every",
                 copy: bool = False) -> None:
        if when not in get_args(VerifyPush):
            raise ValueError(f"engine.verify_push={when!r}: expected every, first or never")
        self.reference, self.token_ids, self.atol, self.when = reference, list(token_ids), atol, when
        self.copy = copy
        self.checks = 0
        self.last: dict[str, float] = {}
        """The last check: probe/max_gap, probe/worker (of the largest gap), time/push_s, time/verify_s."""
        self._unprobed_logged = False

    @classmethod
    def from_config(cls, engine_cfg, model_cfg, policy: torch.nn.Module, copy: bool = False) -> "PushCheck | None":
        """None with engine.verify_push=never. `copy`: check against a copy of `policy` built from
        its config (loaded with the pushed weights at each check, on the CPU) instead of `policy`
        itself; a half-precision model.dtype always checks against such a copy, in that dtype, on
        the policy's device."""
        if engine_cfg.verify_push == "never":
            return None
        atol = engine_cfg.verify_atol if engine_cfg.verify_atol is not None else default_atol(model_cfg.dtype)
        reference = policy
        if copy and is_lora(policy) and model_cfg.lora.push == "adapter":  # the pushes carry the adapter alone
            import dataclasses

            from periodic_async.model import load_policy

            reference, _ = load_policy(dataclasses.replace(model_cfg, device="cpu"))
            if model_cfg.dtype in get_args(HalfDType):  # scored in float32 (an exact upcast)
                reference = reference.float()
        elif copy or model_cfg.dtype in get_args(HalfDType):
            # Half precision: the engines hold the pushed half weights and compute in half, whose
            # rounding alone moves a trained model's probe log-probs by far more than any atol
            # (docs/gpu.md): score them the engines' way, on a half copy of the pushed weights.
            from transformers import AutoModelForCausalLM

            dtype = torch.float32 if model_cfg.dtype not in get_args(HalfDType) else getattr(torch, model_cfg.dtype)
            device = "cpu" if copy else next(policy.parameters()).device  # copy: FSDP ranks' full weights
            with torch.device(device):
                reference = AutoModelForCausalLM.from_config(policy.config, dtype=dtype)
            copy = True
        return cls(reference, probe_tokens(policy.config.vocab_size), atol, engine_cfg.verify_push, copy=copy)

    def due(self) -> bool:
        return self.when == "every" or (self.when == "first" and self.checks == 0)

    def after_push(self, engine: Engine, version: int, push_s: float,
                   state_dict: dict[str, torch.Tensor] | None = None) -> dict[int, float] | None:
        """Compare `engine`'s probe log-probs with the reference's; returns {worker: max |gap|},
        None when not due or when the engine cannot be probed. Raises EngineError above `atol`.
        `state_dict`: the pushed weights (needed with `copy`)."""
        self.last = {}
        if not self.due():
            return None
        t = time.perf_counter()
        engine_lp = engine.probe_logprobs(self.token_ids)
        if engine_lp is None:
            if not self._unprobed_logged:
                logger.info("weight push: %s cannot be probed; pushes are not verified", type(engine).__name__)
                self._unprobed_logged = True
            return None
        if self.copy:
            if state_dict is None:
                raise ValueError("PushCheck(copy=True).after_push needs the pushed state_dict")
            dtype = next(self.reference.parameters()).dtype
            if is_lora(self.reference):
                load_adapter(self.reference, {k: v.to(dtype) for k, v in state_dict.items()})
            else:
                self.reference.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()})
        ref = model_logprobs(self.reference, self.token_ids)
        self.checks += 1
        gaps = {}
        for w, lp in sorted(engine_lp.items()):
            lp = np.asarray(lp, dtype=np.float64)
            if lp.shape != ref.shape:
                raise EngineError(f"weight push to version {version}: probe returned {lp.shape[0]} log-probs, "
                                  f"expected {ref.shape[0]}", w)
            gaps[w] = float(np.max(np.abs(lp - ref))) if np.all(np.isfinite(lp)) else float("inf")
        worst = max(gaps, key=gaps.get)
        verify_s = time.perf_counter() - t
        self.last = {"probe/max_gap": gaps[worst], "probe/worker": worst, "time/push_s": push_s,
                     "time/verify_s": verify_s}
        if gaps[worst] > self.atol:
            raise EngineError(f"weight push to version {version} did not take: its probe log-probs differ from "
                              f"the trainer's by {gaps[worst]:.3g} (> engine.verify_atol={self.atol:g}; all workers: "
                              + ", ".join(f"{w}: {g:.2g}" for w, g in gaps.items()) + ")", worst)
        logger.info("weight push to version %d: %.3f s; probe log-prob gap %.2e (max over %d workers, worker %d; "
                    "atol %g), checked in %.3f s", version, push_s, gaps[worst], len(gaps), worst, self.atol,
                    verify_s)
        return gaps
