"""Sequence-level unlikelihood fine-tuning (Welleck et al. 2019, "Neural Text Generation with Unlikelihood
Training") of a code LM built by make_code_lm.py, run beside it.

Each step adds to the builder's next-token loss on its training windows an unlikelihood loss on the model's own
greedy continuations of short prompts: every continuation token that completes a 4-gram already seen earlier in
that continuation gets -log(1 - p(token)). The prompts are half random 32-token pieces of the training stream and
half a document start (</s>) followed by a top-level `def ...:` line of the training corpus. The corpus, tokenizer,
validation split and held-out evaluation are the builder's own.

    python ul_finetune.py --init-from target --out target_ul --minutes 3.5
"""
import argparse
import json
import os
import re
import shutil
import time

import numpy as np
import tokenizers
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

import make_code_lm as m

NGRAM = 4
SIGNATURE = re.compile(r"^def \w+\([^()\n]{0,60}\):$", re.M)


def repeated_ngram_mask(tokens_BxL: np.ndarray, start: int, n: int = NGRAM) -> np.ndarray:
    """[B, L] bool: positions >= start whose token ends an n-gram (within [start, L)) seen earlier there."""
    B, L = tokens_BxL.shape
    mask = np.zeros((B, L), bool)
    for b in range(B):
        seen = set()
        row = tokens_BxL[b].tolist()
        for t in range(start + n - 1, L):
            gram = tuple(row[t - n + 1:t + 1])
            if gram in seen:
                mask[b, t - n + 1:t + 1] = True
            seen.add(gram)
    return mask


@torch.no_grad()
def greedy(model, prompt_BxP: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy continuation of every prompt (equal lengths), with the KV cache; [B, P + new]."""
    model.eval()
    with torch.autocast(prompt_BxP.device.type, torch.bfloat16):
        out = model(input_ids=prompt_BxP, use_cache=True)
        past, tokens = out.past_key_values, [prompt_BxP, out.logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(new - 1):
            out = model(input_ids=tokens[-1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    model.train()
    return torch.cat(tokens, 1)


def repetition(tokens_BxL: torch.Tensor, start: int) -> float:
    """Fraction of the continuations' 4-grams that repeat an earlier one of the same continuation (seq-rep-4)."""
    rows = tokens_BxL[:, start:].tolist()
    reps = [1 - len({tuple(r[i:i + NGRAM]) for i in range(len(r) - NGRAM + 1)}) / (len(r) - NGRAM + 1)
            for r in rows]
    return float(np.mean(reps))


class Prompts:
    """Random stream pieces and </s> + signature lines (grouped by token length, so each batch is rectangular)."""

    def __init__(self, stream, signatures_by_len: dict, eos: int, seed: int):
        self.stream, self.eos, self.rng = stream, eos, np.random.default_rng(seed)
        self.by_len = {k: v for k, v in signatures_by_len.items() if len(v) >= 16}

    def stream_pieces(self, count: int, length: int = 32) -> np.ndarray:
        starts = self.rng.integers(0, len(self.stream) - length, count)
        return self.stream[starts[:, None] + np.arange(length)].astype(np.int64)

    def signatures(self, count: int) -> np.ndarray:
        length = self.rng.choice(sorted(self.by_len))
        rows = self.by_len[length]
        picked = [rows[i] for i in self.rng.integers(0, len(rows), count)]
        return np.array([[self.eos] + r for r in picked], np.int64)


def signatures_by_length(tok, repos) -> dict:
    """The distinct top-level `def ...:` lines of the repos' files, as token ids grouped by length (4-14)."""
    lines = sorted({s for r in repos for _, text in r.texts for s in SIGNATURE.findall(text)})
    by_len: dict = {}
    for enc in tok.encode_batch(lines, add_special_tokens=False):
        if 4 <= len(enc.ids) <= 14:
            by_len.setdefault(len(enc.ids), []).append(enc.ids)
    return by_len


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--init-from", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=3.5)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ul-weight", type=float, default=1.0)
    p.add_argument("--ul-batch", type=int, default=128, help="continuations per step")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per continuation")
    p.add_argument("--regen-every", type=int, default=16, help="steps between fresh continuations")
    p.add_argument("--mle-rows", type=int, default=4, help="training windows of --seq tokens per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-chars", type=int, default=0, help="the builder's corpus cap (0: all; a small one tests)")
    p.add_argument("--seq", type=int, default=0, help="training window (0: the builder's)")
    a = p.parse_args()
    t_start = time.time()
    torch.manual_seed(a.seed)
    torch.set_float32_matmul_precision("high")
    device = torch.device(a.device)
    b = m.parse_args(["--max-chars", str(a.max_chars)] + (["--seq", str(a.seq)] if a.seq else []))
    # the builder's defaults otherwise: corpus filters, held-out repos, seq, val split
    repos, _ = m.discover_repos()
    m.load_corpus(repos, b)
    for repo in repos.values():
        repo.docs = m.pack_documents(repo, b.doc_chars)
    held = {n.strip().lower() for n in b.held_out.split(",") if n.strip()}
    train_repos, held_repos, _ = m.split_repos(repos, held)
    tok = tokenizers.Tokenizer.from_file(os.path.join(a.init_from, "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    train_docs = [d for r in train_repos for d in r.docs]
    stream = m.pack_stream(m.encode_documents(tok, train_docs), eos, tok.get_vocab_size())
    train_stream, val_blocks = m.split_validation(stream, b.seq + 1, b.val_frac)
    m.log(f"ul: {len(train_stream):,} training tokens; corpus ready after {time.time() - t_start:.0f} s")
    prompts = Prompts(train_stream, signatures_by_length(tok, train_repos), eos, a.seed)
    held_prompts = Prompts(m.pack_stream(m.encode_documents(tok, [d for r in held_repos for d in r.docs]), eos,
                                         tok.get_vocab_size()), signatures_by_length(tok, held_repos), eos, a.seed + 1)

    model = LlamaForCausalLM.from_pretrained(a.init_from, dtype=torch.float32).to(device)
    model.config.use_cache = True
    sampler = m.WindowSampler(train_stream, b.seq, a.mle_rows, a.seed, device)
    opt = m.make_optimizer(model, argparse.Namespace(weight_decay=b.weight_decay, lr=a.lr, beta1=b.beta1,
                                                     beta2=b.beta2), device)
    schedule = m.LRSchedule(a.warmup, a.min_lr_ratio)

    def held_repetition():
        sig = held_prompts.signatures(256)
        pieces = held_prompts.stream_pieces(256)
        return {"signatures": repetition(greedy(model, torch.from_numpy(sig).to(device), a.new_tokens), sig.shape[1]),
                "stream_pieces": repetition(greedy(model, torch.from_numpy(pieces).to(device), a.new_tokens), 32)}

    before = held_repetition()
    m.log(f"ul: held-out greedy seq-rep-4 before: {before}")
    budget, step, pool, curve = a.minutes * 60, 0, None, []
    t_train = time.time()
    while True:
        if step % a.regen_every == 0:
            half = a.ul_batch * a.regen_every // 2
            pool = []
            for prompt in (prompts.stream_pieces(half), prompts.signatures(half)):
                seqs = greedy(model, torch.from_numpy(prompt).to(device), a.new_tokens)
                mask = repeated_ngram_mask(seqs.cpu().numpy(), prompt.shape[1])
                pool.append((seqs, torch.from_numpy(mask).to(device), prompt.shape[1]))
        factor = schedule.factor(step)
        for group in opt.param_groups:
            group["lr"] = a.lr * factor
        inputs, targets = sampler.next()
        with torch.autocast(device.type, torch.bfloat16):
            logits = model(input_ids=inputs, use_cache=False).logits
            mle = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
            del logits
            ul, marked = 0.0, 0
            k = step % a.regen_every
            for seqs, mask, start in pool:
                rows = slice(k * a.ul_batch // 2, (k + 1) * a.ul_batch // 2)
                x, mk = seqs[rows], mask[rows]
                logp = F.log_softmax(model(input_ids=x[:, :-1], use_cache=False).logits.float(), -1)
                lp = logp.gather(-1, x[:, 1:, None])[..., 0][:, start - 1:]
                mk = mk[:, start:]
                term = -torch.log1p(-lp.exp().clamp(max=1 - 1e-5))
                ul = ul + (term * mk).sum() / mk.numel()
                marked += int(mk.sum())
        loss = mle + a.ul_weight * ul / len(pool)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), b.grad_clip)
        opt.step()
        step += 1
        spent = time.time() - t_train
        if step == 20:
            schedule.total = int(budget / (spent / step))
        if step % 20 == 0:
            curve.append(dict(step=step, mle=float(mle), ul=float(ul), marked=marked, lr=a.lr * factor))
            m.log(f"ul: step {step} mle {float(mle):.4f} ul {float(ul):.4f} marked {marked} lr {a.lr * factor:.2e} "
                  f"{spent:.0f}s")
        if spent > budget:
            break
    m.log(f"ul: {step} steps in {time.time() - t_train:.0f} s")
    after = held_repetition()
    m.log(f"ul: held-out greedy seq-rep-4 after: {after}")

    os.makedirs(a.out, exist_ok=True)
    shards = m.save_model(model, a.out, "15MB")  # casts to bf16: the evaluation below scores the saved weights
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "manifest.json"):
        if os.path.exists(os.path.join(a.init_from, name)):
            shutil.copy(os.path.join(a.init_from, name), a.out)
    m.add_compat_fields(a.out, model.config.rope_theta if hasattr(model.config, "rope_theta") else 1e6)
    val_loss, val_tokens = m.mean_loss_on_windows(model, list(val_blocks), device, True, 4)
    heldout = m.evaluate_heldout(model, tok, m.select_heldout_docs(held_repos, b.heldout_docs), eos, b.seq, device,
                                 True)
    m.log(f"eval: validation loss {val_loss:.4f}; held-out loss {heldout['loss']:.4f}")
    log = json.load(open(os.path.join(a.init_from, "train_log.json")))
    log.update(weight_files=shards, weight_bytes_total=sum(shards.values()), val_loss=val_loss,
               val_tokens=val_tokens, heldout=heldout, sample=None,
               unlikelihood=dict(args=vars(a), steps=step, tokens_mle=step * a.mle_rows * b.seq,
                                 continuations=step * a.ul_batch, greedy_seq_rep_4_before=before,
                                 greedy_seq_rep_4_after=after, curve=curve,
                                 wall_s=time.time() - t_start))
    m.write_json(os.path.join(a.out, "train_log.json"), log)
    for name in os.listdir(a.out):
        os.chmod(os.path.join(a.out, name), 0o644)


if __name__ == "__main__":
    main()
