"""Checkpoints that mean what they say: `checkpoint-<t>` holds the state after exactly t completed
iterations, and a run resumed from it continues the uninterrupted run's trajectory (same
prompts, same sampled tokens, same weights: tests/test_checkpoint.py).

Layout under `trainer.output_dir`:

    checkpoint-<t>/          t = iterations completed = the policy's version
        model.safetensors    the policy theta_t, with config.json: a Hugging Face model
                             directory (usable as model.name_or_path), plus the tokenizer
        trainer_state.pt     optimizer, lr-scheduler (and fp16 loss-scaler) state
        rng_state.pt         torch CPU (and CUDA) generators, python `random`, numpy's global RNG
        checkpoint.json      iteration, version, data position, the reference's source and
                             the hash of its weights
        complete             the marker, written last
    checkpoint -> checkpoint-<newest>   a symbolic link, moved after each save

With LoRA (`model.lora.enabled`) the checkpoint holds the adapter and the merged policy:

    checkpoint-<t>/
        model.safetensors    the merged policy theta_t = base + (alpha / r) B A, in model.dtype,
                             with config.json: the same Hugging Face model directory as without
                             LoRA, so `model.name_or_path=<run>/checkpoint` still loads the
                             trained policy as a plain model (with model.lora.enabled a new
                             adapter trains on top of it)
        adapter/             adapter_config.json + adapter_model.safetensors: what
                             `peft.PeftModel.from_pretrained(base, <run>/checkpoint/adapter)`
                             loads, and what a resume restores (the base is the run's initial
                             weights, checked by their hash as below)
        trainer_state.pt, rng_state.pt, checkpoint.json (+ "lora": its settings, which a resume
                             must have too), complete

Guarantees:
- Atomic. A checkpoint is written into `checkpoint-<t>.tmp`, its `complete` marker last, and
  renamed into place. `trainer.resume=auto` takes the newest `checkpoint-<t>` holding the
  marker; a directory without it, or a `.tmp` left by a crash, is never loaded (the next save
  removes it). Saving runs with signals deferred (`interrupt.deferred`).
- The label matches the weights. t is the consumer's `version`, which changes together with
  the optimizer step, so the checkpoint saved after a failure anywhere (a producer error, a
  failed barrier, a signal) holds theta_t under the label t. A non-finite gradient is never
  stepped, so the last checkpoint stays the last good state.
- No pickle. Weights are safetensors; the other files hold tensors and plain containers,
  loaded with `torch.load(weights_only=True)`; checkpoint.json is JSON.
- The data position is the iteration. An iteration's prompts are a pure function of
  (iteration, data.seed) (`data.iteration_prompts`), and each request's sampling seed one of
  (data.seed, iteration, position in the iteration) (`producer.request_seed`): t is all a resume needs.
- The reference is the original run's. The tri-model's ref is the run's initial weights,
  built from `model.name_or_path` (and `model.seed` for a preset), never from a checkpoint:
  the checkpoint records that source and a hash of those weights (`reference_hash`, computed
  once at the start of the run), and a resume whose initial weights hash otherwise is refused,
  whatever the path says (e.g. model.name_or_path pointing at the checkpoint, whose ref would be
  the resumed policy; a model directory rewritten in place with other weights). A checkpoint
  without the hash (or a caller that gives none) is checked by its source instead.
- One format for every layout. Trainer ranks (torchrun; distributed.py) write the single
  process's files: under ddp rank 0 holds the whole state, under fsdp it is gathered to rank
  0's CPU first; rank 0 alone writes, every rank takes part in each save (`trainer.save_every`,
  the end) and none goes on before checkpoint-<t> is complete and renamed (or raises what rank
  0 raised). A resume is loaded by every rank from the files rank 0 reads. So a checkpoint
  written by N ranks resumes in one process and the other way round (tests/test_distributed.py),
  and `model.name_or_path=<run>/checkpoint` loads it anywhere. The RNG state is rank 0's, the
  one that samples. After a failure only a single process or ddp's rank 0 saves: under fsdp the
  gather would need ranks that may never join it, and the newest `trainer.save_every`
  checkpoint stays the last good one.
- The last `trainer.keep_last` complete checkpoints are kept; older ones are removed only once
  the new one is complete. Checkpoints numbered above a new save belong to another trajectory
  (a resume from an earlier checkpoint) and are removed too; a fresh run (no resume) removes
  the earlier run's checkpoints, as it removes its logs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from periodic_async import interrupt
from periodic_async.config import ModelConfig, RunConfig
from periodic_async.lora import adapter_names, is_lora, merge_lora

LATEST = "checkpoint"
"""The symbolic link to the newest complete checkpoint (what `model.name_or_path=<run>/checkpoint` loads)."""
MARKER = "complete"
ADAPTER = "adapter"
"""With LoRA: the subdirectory holding the adapter (a peft adapter directory)."""
_NAME = re.compile(r"checkpoint-(\d+)")


def path(out_dir: Path, iteration: int) -> Path:
    return Path(out_dir) / f"checkpoint-{iteration}"


def is_complete(ckpt: Path) -> bool:
    return (Path(ckpt) / MARKER).is_file()


def complete_checkpoints(out_dir: Path) -> dict[int, Path]:
    """{t: checkpoint-<t>} of the complete checkpoints under `out_dir`, oldest first."""
    found = {}
    for p in Path(out_dir).glob("checkpoint-*"):
        m = _NAME.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink() and is_complete(p):
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def latest(out_dir: Path) -> Path | None:
    """The newest complete checkpoint under `out_dir`, or None."""
    found = complete_checkpoints(out_dir)
    return found[max(found)] if found else None


def resume_dir(cfg: RunConfig) -> Path | None:
    """The checkpoint `trainer.resume` names: 'auto' = the newest complete one in output_dir
    (None if there is none: a fresh start); else that directory, which must be complete."""
    resume = cfg.trainer.resume
    if not resume:
        return None
    if resume == "auto":
        return latest(Path(cfg.trainer.output_dir))
    if not is_complete(Path(resume)):
        raise FileNotFoundError(f"trainer.resume={resume!r}: not a complete checkpoint (no {MARKER!r} marker)")
    return Path(resume)


def reference_source(model: ModelConfig) -> dict:
    """Where the tri-model's reference (the initial weights) comes from: a model directory, or a
    preset and its initialisation seed."""
    p = Path(model.name_or_path)
    if p.is_dir():
        return {"name_or_path": str(p.resolve())}
    return {"name_or_path": model.name_or_path, "seed": model.seed}


def reference_hash(model) -> str:
    """The identity of the reference's weights: sha256 (its first 16 hex digits) over every
    tensor of `model.state_dict()` in name order, with its name, dtype and shape. Computed on
    the initial policy as loaded (model.dtype), before any step; the same weights give the same
    hash on any device and in any process."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:16]


def remove_all(out_dir: Path) -> None:
    """A fresh run: the earlier run's checkpoints (complete or not) and the link go."""
    out_dir = Path(out_dir)
    link = out_dir / LATEST
    if link.is_symlink():
        link.unlink()
    elif link.is_dir():  # the single-directory layout of earlier versions
        shutil.rmtree(link)
    for p in out_dir.glob("checkpoint-*"):
        shutil.rmtree(p, ignore_errors=True)
    (out_dir / f"{LATEST}.link-tmp").unlink(missing_ok=True)


def save(out_dir: Path, iteration: int, policy, tokenizer, consumer, cfg: RunConfig, collective: bool = True,
         reference: str | None = None) -> Path:
    """Write checkpoint-<iteration> atomically, move the link, keep the last trainer.keep_last.
    Trainer ranks: every rank calls it (`collective`): the whole state comes to rank 0 (a gather
    under fsdp), rank 0 writes, and every rank returns once the checkpoint is complete, or
    raises if writing it failed. collective=False: rank 0 writes what it holds, alone (after a
    failure, where the other ranks may never join; not possible under fsdp). `reference`: the
    `reference_hash` of the run's initial weights, recorded for the resume's check."""
    ranks = consumer.ranks
    with interrupt.deferred():
        if collective:
            weights, optimizer = ranks.checkpoint_state(policy, consumer.optimizer)
            return ranks.from_main(lambda: _write(out_dir, iteration, policy, tokenizer, consumer, cfg, weights,
                                                  optimizer, reference))
        if ranks.lockstep or not ranks.is_main:
            raise RuntimeError("checkpoint.save(collective=False): only one process or ddp's rank 0 holds the "
                               "whole state")
        return _write(out_dir, iteration, policy, tokenizer, consumer, cfg, None, consumer.optimizer.state_dict(),
                      reference)


def _write(out_dir: Path, iteration: int, policy, tokenizer, consumer, cfg: RunConfig, weights: dict | None,
           optimizer: dict, reference: str | None = None) -> Path:
    """The files of checkpoint-<iteration> (weights: the policy's, whole; None: its own state dict)."""
    out_dir = Path(out_dir)
    final, tmp = path(out_dir, iteration), out_dir / f"checkpoint-{iteration}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if is_lora(policy):
        state = policy.state_dict() if weights is None else weights
        policy.save_pretrained(tmp / ADAPTER, state_dict=state, save_embedding_layers=False)
        policy.get_base_model().save_pretrained(tmp, state_dict=merge_lora(policy, state))
    else:
        policy.save_pretrained(tmp, **({} if weights is None else {"state_dict": weights}))
    if not list(tmp.glob("*.safetensors")) or list(tmp.glob("*.bin")):
        raise RuntimeError(f"checkpoint {tmp}: the weights were not written as safetensors")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save({**consumer.state_dict(), "optimizer": optimizer}, tmp / "trainer_state.pt")
    torch.save(_rng_state(), tmp / "rng_state.pt")
    (tmp / "checkpoint.json").write_text(json.dumps({
        "iteration": iteration, "version": iteration,
        "data_position": {"iteration": iteration, "seed": cfg.data.seed,
                          "note": "the prompts of iteration t are data.iteration_prompts(t, data.seed)"},
        "reference": reference_source(cfg.model), "saved_at": time.time(),
        **({"reference_weights": reference} if reference is not None else {}),
        "trainer_ranks": consumer.ranks.world_size,
        **({"lora": dataclasses.asdict(cfg.model.lora)} if is_lora(policy) else {}),
    }, indent=2))
    (tmp / MARKER).write_text(f"{iteration}\n")
    old = out_dir / f"checkpoint-{iteration}.old"
    if final.exists():  # the same iteration again (a resume from an earlier checkpoint)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    _link_latest(out_dir, final)
    _prune(out_dir, iteration, cfg.trainer.keep_last)
    return final


def resume(cfg: RunConfig, consumer, reference: str | None = None) -> Path | None:
    """Load the checkpoint `trainer.resume` names (`resume_dir`) into `consumer`; returns it, or
    None for a fresh start. Trainer ranks: every rank calls it; rank 0 finds the checkpoint (its
    output directory) and the ranks load it together. `reference`: the `reference_hash` of this
    run's initial weights (rank 0's), which must be the checkpoint's."""
    ckpt = consumer.ranks.from_main(lambda: resume_dir(cfg))
    if ckpt is not None:
        load(ckpt, consumer.policy, consumer, cfg, reference)
    return ckpt


def _read_info(ckpt: Path, cfg: RunConfig, reference: str | None = None) -> dict:
    """checkpoint.json, refused when this run's reference differs from the checkpoint's: by the
    hash of the weights when both are known (`reference`), else by the source."""
    info = json.loads((ckpt / "checkpoint.json").read_text())
    lora = dataclasses.asdict(cfg.model.lora) if cfg.model.lora.enabled else None
    if info.get("lora") != lora:  # the adapter's shape and scaling (alpha / rank) are the run's
        raise ValueError(f"trainer.resume: checkpoint {str(ckpt)!r} was trained with model.lora={info.get('lora')}, "
                         f"this run has model.lora={lora}: resume with the checkpoint's model.lora settings")
    if reference is not None and info.get("reference_weights") is not None:
        if info["reference_weights"] != reference:
            raise ValueError(f"trainer.resume: checkpoint {str(ckpt)!r} was trained against reference weights "
                             f"{info['reference_weights']} ({info['reference']}), this run's initial weights from "
                             f"model.name_or_path={cfg.model.name_or_path!r} (model.seed={cfg.model.seed}) hash to "
                             f"{reference}: resume with the original run's initial weights (the reference is the "
                             "initial weights, not the checkpoint)")
        return info
    if info["reference"] != reference_source(cfg.model):
        raise ValueError(f"trainer.resume: checkpoint {str(ckpt)!r} was trained against the reference "
                         f"{info['reference']}, this run's model.name_or_path={cfg.model.name_or_path!r} "
                         f"(model.seed={cfg.model.seed}) gives {reference_source(cfg.model)}: resume with the "
                         "original run's model settings (the reference is the initial weights, not the checkpoint)")
    return info


def _read_weights(ckpt: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    saved: dict[str, torch.Tensor] = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        saved.update(load_file(f, device=device))
    return saved


def _load_weights(policy, saved: dict[str, torch.Tensor], ckpt: Path) -> None:
    result = policy.load_state_dict(saved, strict=False)
    current = policy.state_dict()
    loaded_ptrs = {current[k].data_ptr() for k in saved if k in current}
    untied = [k for k in result.missing_keys if current[k].data_ptr() not in loaded_ptrs]
    if untied or result.unexpected_keys:
        raise ValueError(f"checkpoint {str(ckpt)!r} does not fit the policy: missing {untied}, "
                         f"unexpected {result.unexpected_keys}")


def _read_adapter(ckpt: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    f = Path(ckpt) / ADAPTER / "adapter_model.safetensors"
    if not f.is_file():
        raise ValueError(f"checkpoint {str(ckpt)!r} has no LoRA adapter ({ADAPTER}/adapter_model.safetensors): it was "
                         "not written with model.lora.enabled; resume it with model.lora.enabled=false")
    return load_file(f, device=device)


def _adapter_as_params(policy, saved: dict[str, torch.Tensor], ckpt: Path) -> dict[str, torch.Tensor]:
    """The adapter files' tensors under the policy's parameter names; a mismatch is a ValueError."""
    names = adapter_names(policy)
    missing, unexpected = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(ckpt)!r}: its LoRA adapter does not fit the policy's (model.lora): "
                         f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, unexpected "
                         f"{unexpected[:4]}{'...' if len(unexpected) > 4 else ''}")
    return {names[f]: t for f, t in saved.items()}


def _load_adapter(policy, saved: dict[str, torch.Tensor], ckpt: Path) -> None:
    params = dict(policy.named_parameters())
    with torch.no_grad():
        for name, t in _adapter_as_params(policy, saved, ckpt).items():
            if params[name].shape != t.shape:
                raise ValueError(f"checkpoint {str(ckpt)!r}: adapter tensor {name} has shape {tuple(t.shape)}, the "
                                 f"policy's {tuple(params[name].shape)} (another model.lora.rank?)")
            params[name].copy_(t)


def load(ckpt: Path, policy, consumer, cfg: RunConfig, reference: str | None = None) -> int:
    """Restore the policy (and old), optimizer, scheduler and RNG states from `ckpt` into a
    consumer built from `cfg` (whose ref is the initial weights); returns the iteration to
    run next. Refuses a run whose reference differs from the checkpoint's (`_read_info`:
    `reference` is the `reference_hash` of its initial weights; None: its source is compared).
    Trainer ranks: every rank calls it (rank 0's `ckpt` counts; the others may not see it)."""
    if consumer.ranks.distributed:
        return _load_ranks(Path(ckpt) if ckpt is not None else None, policy, consumer, cfg, reference)
    ckpt = Path(ckpt)
    info = _read_info(ckpt, cfg, reference)
    device = next(policy.parameters()).device
    if is_lora(policy):
        _load_adapter(policy, _read_adapter(ckpt, str(device)), ckpt)
    else:
        _load_weights(policy, _read_weights(ckpt, str(device)), ckpt)
    consumer.tri.refresh_old()
    consumer.load_state_dict(torch.load(ckpt / "trainer_state.pt", weights_only=True))
    consumer.version = int(info["iteration"])
    _set_rng_state(torch.load(ckpt / "rng_state.pt", weights_only=True))
    return int(info["iteration"])


def _load_ranks(ckpt: Path | None, policy, consumer, cfg: RunConfig, reference: str | None = None) -> int:
    """`load` on trainer ranks: rank 0 reads the files; weights and optimizer state go to every
    rank's (sharded) models through torch.distributed.checkpoint, the rest in one broadcast."""
    ranks, local = consumer.ranks, {}

    def read() -> dict:
        info = _read_info(ckpt, cfg, reference)
        local["weights"] = (_adapter_as_params(policy, _read_adapter(ckpt), ckpt) if is_lora(policy)
                            else _read_weights(ckpt))
        local["trainer"] = torch.load(ckpt / "trainer_state.pt", weights_only=True)
        local["rng"] = torch.load(ckpt / "rng_state.pt", weights_only=True)
        if "optimizer" not in local["trainer"]:
            raise KeyError(f"checkpoint {str(ckpt)!r}: trainer_state.pt has no optimizer state")
        return {"iteration": int(info["iteration"]),
                "trainer": {k: v for k, v in local["trainer"].items() if k != "optimizer"}}

    head = ranks.from_main(read)
    ranks.load_checkpoint_state(policy, consumer.optimizer, local.get("weights"),
                                local.get("trainer", {}).get("optimizer"), trainable_only=is_lora(policy))
    consumer.tri.refresh_old()
    consumer.load_state_dict(head["trainer"], optimizer=False)
    consumer.version = head["iteration"]
    if ranks.is_main:
        _set_rng_state(local["rng"])
    return head["iteration"]


class Checkpoints:
    """The checkpoints of one run: every `trainer.save_every` iterations, after a failure, at the end.
    Trainer ranks: every rank keeps one and calls `every` and `save` at the same points of the
    loop (a save is collective); `after_failure` is rank 0's alone."""

    def __init__(self, cfg: RunConfig, policy, tokenizer, consumer, reference: str | None = None) -> None:
        self.cfg, self.policy, self.tokenizer, self.consumer = cfg, policy, tokenizer, consumer
        self.reference = reference
        """The `reference_hash` of the run's initial weights, written into each checkpoint."""
        self.out = Path(cfg.trainer.output_dir)
        self.start = consumer.version
        self.saved: set[int] = set()

    def save(self, iteration: int, collective: bool = True) -> Path:
        if iteration not in self.saved:
            save(self.out, iteration, self.policy, self.tokenizer, self.consumer, self.cfg, collective=collective,
                 reference=self.reference)
            self.saved.add(iteration)
        return path(self.out, iteration)

    def every(self, completed: int) -> None:
        """After iteration completed-1: save when trainer.save_every divides `completed`."""
        if self.cfg.trainer.save_every and completed % self.cfg.trainer.save_every == 0:
            self.save(completed)

    def after_failure(self) -> None:
        """Keep what was trained: the weights of the consumer's version (the last completed
        iteration; a failed iteration never stepped). With several optimizer steps per
        iteration a failure may fall between them, where no label fits: nothing is saved.
        Rank 0 alone: under fsdp (sharded state, other ranks perhaps gone) nothing is saved."""
        if self.cfg.algorithm.optimizer_steps_per_iteration == 1 and self.consumer.version > self.start:
            if self.consumer.ranks.lockstep:
                print(f"[train] trainer.parallel=fsdp: no checkpoint after a failure (the sharded state needs "
                      f"every rank to gather it); the newest complete one is {latest(self.out)}")
                return
            self.save(self.consumer.version, collective=False)


def _link_latest(out_dir: Path, target: Path) -> None:
    link, tmp = out_dir / LATEST, out_dir / f"{LATEST}.link-tmp"
    if link.exists() and not link.is_symlink():  # the single-directory layout of earlier versions
        shutil.rmtree(link)
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    tmp.replace(link)  # atomic


def _prune(out_dir: Path, newest: int, keep_last: int) -> None:
    for p in [*out_dir.glob("checkpoint-*.tmp"), *out_dir.glob("checkpoint-*.old")]:
        shutil.rmtree(p, ignore_errors=True)
    found = complete_checkpoints(out_dir)
    upto = [t for t in found if t <= newest]
    kept = upto[-keep_last:] if keep_last else upto  # keep_last 0: every one
    for t, p in found.items():
        if t not in kept:
            shutil.rmtree(p)
    for p in out_dir.glob("checkpoint-*"):  # incomplete directories under a checkpoint's name
        m = _NAME.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink() and not is_complete(p):
            shutil.rmtree(p, ignore_errors=True)


def _rng_state() -> dict:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss},
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
