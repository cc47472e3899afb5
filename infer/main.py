"""Generate text from a prompt, streaming it to stdout: ``python -m infer.main --prompt "def f(" --max-new-tokens 32``.

Without ``--target``, the embedded default model (``infer/default_model/target``) runs with its LongSpec draft
(``infer/default_model/draft``: speculative decoding; ``--no-draft`` for plain decoding, ``--draft DIR`` for
another draft). ``--tiny-random`` runs a tiny random Llama built in memory with a byte-level tokenizer instead (its
text is noise, but the whole path runs). Timing goes to stderr: the compilation, the prefill and the decode rate
(tokens/s over decoding alone), and with a draft the tokens per round (tau); ``--repeat N`` adds N warm calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


DEFAULT_MODEL = Path(__file__).resolve().parent / "default_model"  # target/ and draft/; see its README.md
DTYPES = ("bfloat16", "float32")
DRAFT_SAMPLING = {"beams": False, "without_replacement": "without_replacement", "top_plus_one": "top_plus_one"}


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (for the tiny random model, which has no tokenizer)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class TextStreamer:
    """Prints the decoded text of row 0 as tokens arrive, holding back an incomplete UTF-8 / BPE tail."""

    def __init__(self, decode, out=None):
        self.decode = decode
        self.out = out
        self.ids: list[int] = []
        self.printed = ""
        self.enabled = True

    def __call__(self, tokens_B, emitted_B) -> None:
        if emitted_B[0]:
            self.ids.append(int(tokens_B[0]))
            if self.enabled:
                self._flush(final=False)

    def _flush(self, final: bool) -> None:
        text = self.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            return  # wait for the rest of a multi-byte character
        if text.startswith(self.printed):
            new = text[len(self.printed):]
        else:  # an earlier piece decoded differently in context: print only what is new past the common part
            common = os.path.commonprefix([text, self.printed])
            new = text[len(common):] if len(text) > len(self.printed) else ""
        if new:
            out = self.out or sys.stdout
            out.write(new)
            out.flush()
            self.printed += new

    def finish(self) -> None:
        if self.enabled:
            self._flush(final=True)
            out = self.out or sys.stdout
            out.write("\n")
            out.flush()


def _checked(convert, kind: str, ok, bound: str):
    """An argparse ``type``: ``convert(text)`` (else "expected ``kind``"), kept only if ``ok(value)``."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


_positive_int = _checked(int, "a positive integer", lambda v: v > 0, "a positive integer")
_non_negative_int = _checked(int, "an integer >= 0", lambda v: v >= 0, ">= 0")
temperature_arg = _checked(float, "a number", lambda v: v >= 0, ">= 0")
_top_p = _checked(float, "a number", lambda v: 0 < v <= 1, "in (0, 1]")


def tree_shape_arg(text: str) -> tuple[int, ...]:
    """A tree shape from the command line, ``C0,C1,...`` (argparse type; the benchmarks use it too)."""
    return positive_ints_arg(text)


def positive_ints_arg(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers (argparse type)."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not shape or min(shape) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return shape


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m infer.main", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    source.add_argument("--prompt-file", metavar="F", help="read the prompt from this file ('-' for stdin)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=64, metavar="N")
    parser.add_argument("--temperature", type=temperature_arg, default=0.0, metavar="T",
                        help="0 = greedy (so is any T below 1e-5, longspec_jax.sampling.MIN_TEMPERATURE)")
    parser.add_argument("--top-p", type=_top_p, default=1.0, metavar="P")
    parser.add_argument("--seed", type=int, default=0, metavar="S")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--tree-shape", type=tree_shape_arg, default=None, metavar="C0,C1,...",
                        help="speculative tree: nodes per level (with a draft; default: chosen per call)")
    parser.add_argument("--draft-sampling", choices=DRAFT_SAMPLING, default=None,
                        help="with a draft: the draft's top-k beams, or a tree sampled from it (--temperature > 0) "
                             "without replacement or as top tokens plus one draw (default: chosen per call)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument("--repeat", type=_non_negative_int, default=0, metavar="N",
                        help="after the first (compiling) call, time N more calls without printing")
    return parser


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the models (``python -m infer.main`` and ``python -m infer.serve``)."""
    parser.add_argument("--target", metavar="DIR",
                        help="HF Llama/Qwen2 directory (config.json + *.safetensors [+ tokenizer]); default: the "
                             "embedded default model, with its draft")
    parser.add_argument("--tiny-random", action="store_true",
                        help="use a tiny random Llama built in memory (byte tokenizer) instead of --target")
    parser.add_argument("--draft", metavar="DIR",
                        help="LongSpec draft (speculative decoding); default: the embedded default model's draft "
                             "when --target is not given")
    parser.add_argument("--no-draft", action="store_true", help="plain decoding with the default model")
    parser.add_argument("--draft-vocab", metavar="FILE|full",
                        help="with a draft: propose only from the sorted token ids of this .npy file (a draft "
                             "vocabulary), or from the full vocabulary despite the draft's own draft_vocab.npy")


def check_model_args(args, parser: argparse.ArgumentParser) -> bool:
    """Refuses contradictory or missing model flags (``parser.error``); whether a draft will run."""
    if args.draft is not None and not os.path.exists(args.draft):
        parser.error(f"--draft {args.draft}: no such file or directory")
    if args.no_draft and args.draft is not None:
        parser.error("give either --draft or --no-draft, not both")
    has_draft = args.draft is not None or not (args.no_draft or args.target or args.tiny_random)
    if args.draft_vocab is not None and not has_draft:
        parser.error("--draft-vocab needs a draft (the draft proposes from it)")
    if args.draft_vocab not in (None, "full") and not os.path.isfile(args.draft_vocab):
        parser.error(f"--draft-vocab {args.draft_vocab}: no such file (or 'full')")
    if args.tiny_random and args.target is not None:
        parser.error("give either --target or --tiny-random, not both")
    if args.target is not None and not os.path.isdir(args.target):
        parser.error(f"--target {args.target}: not a directory")
    return has_draft


def tiny_random_target(dtype, seed: int = 0):
    """A 2-layer Llama (vocab 256 = bytes) with random weights, and its byte tokenizer."""
    import jax

    from longspec_jax.config import TargetConfig
    from longspec_jax.target import Target, init_target_params

    config = TargetConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
    params = init_target_params(config, jax.random.PRNGKey(seed), dtype=dtype, std=0.1)
    return Target(config=config, params=params), ByteTokenizer()


def _read_prompt(args, parser) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        if args.prompt_file == "-":
            return sys.stdin.read()
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"cannot read --prompt-file {args.prompt_file}: {e}")


def model_dirs(args) -> tuple[str | None, str | None]:
    """The target and draft directories to load: ``--target`` / ``--draft``, else the embedded default model and
    its draft (``FileNotFoundError`` naming the directory where one is missing); no target for ``--tiny-random``."""
    if args.target is not None or args.tiny_random:
        return args.target, args.draft
    default = {"target": DEFAULT_MODEL / "target", "draft": DEFAULT_MODEL / "draft"}
    wanted = ["target"] + ([] if args.no_draft or args.draft else ["draft"])
    for name in wanted:
        if not (default[name] / "config.json").is_file():
            raise FileNotFoundError(f"the default model's {name} is missing: no config.json in {default[name]} "
                                    "(give --target DIR, or --tiny-random for a tiny random model)")
    return os.fspath(default["target"]), args.draft or (None if args.no_draft else os.fspath(default["draft"]))


def _load(args, path, dtype):
    """Returns (target, tokenizer, description) of the target directory ``path`` (None: the tiny random one)."""
    from longspec_jax import load_target

    if path is None:
        target, tokenizer = tiny_random_target(dtype, args.seed)
        return target, tokenizer, "tiny random Llama (in memory, byte tokenizer)"
    target = load_target(path, dtype=dtype)
    tokenizer = target.tokenizer
    if tokenizer is None:
        if target.config.vocab_size < 256:
            raise ValueError(f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json)")
        tokenizer = ByteTokenizer()
        print(f"[infer.main] {path} has no tokenizer: using UTF-8 bytes as token ids", file=sys.stderr)
    return target, tokenizer, path


def load_draft_arg(path, target, draft_vocab: str | None, prog: str = "infer.main"):
    """The draft in ``path``, proposing from ``draft_vocab`` where given: a ``.npy`` of sorted token ids, or
    ``full`` for the whole vocabulary despite the draft's own ``draft_vocab.npy`` (the ``--draft-vocab`` flag)."""
    from longspec_jax import load_draft
    from longspec_jax.draft_vocab import read_draft_vocab

    if draft_vocab == "full":
        return load_draft(path, target).with_vocab(target, None)
    ids = None if draft_vocab is None else read_draft_vocab(draft_vocab, target.config.vocab_size)
    draft = load_draft(path, target, draft_vocab=ids)
    if draft.vocab is not None:
        print(f"[{prog}] draft vocabulary: {draft.vocab.size} of {target.config.vocab_size} tokens", file=sys.stderr)
    return draft


def phase_report(phases, prompt_tokens: int, generated: int) -> str:
    """The timing of a first call (:class:`infer.phases.CallPhases`): compilation, prefill (the prompt and the
    first token), and the decode rate over the other ``generated - 1`` tokens and the decoding time alone."""
    decoded = generated - 1
    line = f"compile {phases.compile_s:.3g} s; prefill {prompt_tokens} tokens {phases.prefill_s:.3g} s; decode "
    if decoded <= 0:
        return line + "nothing (one token)"
    return line + f"{decoded} tokens in {phases.decode_s:.3g} s: {decoded / phases.decode_s:.1f} tokens/s"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prompt = _read_prompt(args, parser)
    has_draft = check_model_args(args, parser)
    if args.draft_sampling and not has_draft:
        parser.error("--draft-sampling needs a draft (the draft samples the tree)")

    import jax.numpy as jnp

    from infer.generate import generate
    from infer.phases import timing_phases

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    try:
        target_dir, draft_dir = model_dirs(args)
        target, tokenizer, where = _load(args, target_dir, dtype)
        draft = load_draft_arg(draft_dir, target, args.draft_vocab) if draft_dir else None
        ids = list(tokenizer.encode(prompt))
        if not ids:
            raise ValueError("the prompt is empty (it encodes to 0 tokens)")
        print(f"[infer.main] target: {where} ({args.dtype}); draft: {draft_dir or 'none (plain decoding)'}; "
              f"prompt: {len(ids)} tokens", file=sys.stderr)
        kwargs = dict(draft=draft, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_p=args.top_p, seed=args.seed, tree_shape=args.tree_shape,
                      eos_token_id=[] if args.ignore_eos else None,
                      draft_sampling=None if args.draft_sampling is None else DRAFT_SAMPLING[args.draft_sampling])
        streamer = TextStreamer(tokenizer.decode)
        sys.stdout.write(prompt)
        sys.stdout.flush()
        with timing_phases() as phases:
            out = generate(target, [ids], on_tokens=streamer, **kwargs)
        streamer.finish()
        print(f"[infer.main] {phase_report(phases[-1], len(ids), int(out.num_generated[0]))}", file=sys.stderr)
        if out.speculation is not None:
            print(f"[infer.main] speculation: {out.speculation.describe()}", file=sys.stderr)
        if out.speculation is not None and out.speculation.tree_shape is not None:
            print(f"[infer.main] {int(out.num_rounds[0])} rounds: {out.mean_accepted:.2f} tokens per round (tau)",
                  file=sys.stderr)
        if args.repeat:
            streamer.enabled = False
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                again = generate(target, [ids], on_tokens=streamer, **kwargs)
                times.append(time.perf_counter() - start)
                n = int(again.num_generated[0])
            warm = statistics.median(times)
            print(f"[infer.main] warm: median {warm:.4f} s over {args.repeat} run(s) (includes prefill): "
                  f"{n / warm:.2f} tokens/s", file=sys.stderr)
    except (ValueError, OSError) as e:  # LongSpecError is a ValueError: bad model dir, weights, prompt, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
