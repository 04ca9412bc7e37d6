"""First light on a GPU: the paper's claims checked on one CUDA device, and what they cost there.

`scripts/gpu_check.sh OUT` runs each step below as its own process with a time limit (one
failing or timed-out step never hides the others' rows); this package is those steps, one a file:

    python -m periodic_async.bench.gpu STEP --out OUT [--device cuda|cpu] [--toy] [--budget-s S]

    preflight    CUDA present (else exit 2 with one line), the dependencies the steps import,
                 which optional ones (Ray, vLLM, W&B, TRL) are installed; writes nothing
    correctness  correctness.csv: the claims, before any speed
                 - a run on the device samples the tokens a CPU run samples (sync-separated,
                   fp64, in-process engine) and ends within fp64 round-off of its weights;
                 - periodic-async samples what sync-separated samples on the device (the
                   paper's on-policy equivalence; fp64, `engine.backend=local`);
                 - shared-prompt log-probs equal per-response log-probs (the paper's shared-
                   prompt attention), per attention back-end, in fp32 (1e-4) and bf16 autocast
                   (twice bf16's own error against fp32);
                 - the after-push probe gap (engine/verify.py) of a bf16 engine against the fp32
                   trainer: is `engine.verify_atol`'s bf16 default (0.1) right on a GPU;
                 - a short periodic-async run in bf16 (the trainer's mixed precision, the
                   default attention back-end) with its probe gaps and tokens/s
    attention    attention.csv: forward+backward time of one group [prompt | r_1 ... r_G] packed
                 shared against per-response, per back-end (split, FlexAttention, SDPA with the
                 dense mask), at the paper's shapes (Qwen2.5-1.5B architecture, P in {1024,
                 4096}, G = 16, R in {256, 1024}), beside the token bound (G*P + G*R)/(P + G*R)
    trainer      trainer.csv: the tri-model micro-step's packed tokens/s, model FLOPs
                 utilisation and peak memory (Qwen2.5-0.5B and -1.5B architectures; policy
                 only, and policy + reference)
    engine       engine.csv: the built-in continuous-batching engine's decode tokens/s at 64 and
                 256 slots against Hugging Face `generate` (same model, prompts and lengths)

    common.py    what every step shares: sizes, architectures, card specs, budget, provenance

Every CSV row carries the commit, a hash of the package's source, the device's name and the
torch / CUDA versions. Models have random weights, built from the Qwen2.5 configurations in
`common.ARCHS` (nothing is downloaded). `--toy` shrinks every size so that the same code runs on
a CPU in seconds (tests/test_gpu_check.py); `--device cpu` runs the steps without CUDA.

MFU: model FLOPs / time / peak, where the model FLOPs of one forward are 2 x (parameters
outside the embedding) x packed tokens + 2 x hidden x vocabulary x labels (the LM head runs
on the label positions only); a forward+backward is three forwards; attention-score FLOPs are
not counted (as in the usual MFU). Peak: the datasheet's dense bf16 figure of the GPU
(`common.GPU_SPECS`, e.g. 989 TFLOP/s for an H200 SXM), or `--peak-tflops`.
"""
