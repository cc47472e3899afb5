"""Reads an XLA autotune-results textproto, reports its entries, and writes a copy in which the entries of
verification's GEMMs (an operand with a 69-row dimension) take split_k 1."""
import re, sys, collections

src, dst = sys.argv[1], sys.argv[2]
text = open(src).read()
print(f"{src}: {len(text)} chars")


def blocks(t, name="results"):
    """(start, end) of each top-level `name {...}` block."""
    out, i = [], 0
    pat = re.compile(r"(^|\n)\s*" + name + r"\s*\{")
    while True:
        m = pat.search(t, i)
        if not m:
            return out
        j, depth, k = m.end(), 1, m.end()
        instr = False
        while depth:
            c = t[k]
            if instr:
                if c == "\\":
                    k += 1
                elif c == '"':
                    instr = False
            elif c == '"':
                instr = True
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            k += 1
        out.append((m.start(), k))
        i = k


bl = blocks(text)
print(f"{len(bl)} results blocks")
if not bl:
    print(text[:4000])
head = text[:bl[0][0]] if bl else text
print("header:", head[:300].replace("\n", " | "))
kinds = collections.Counter()
pieces, last, edited = [], 0, 0
for n, (a, b) in enumerate(bl):
    blk = text[a:b]
    hm = re.search(r'hlo:\s*"((?:[^"\\]|\\.)*)"', blk)
    hlo = hm.group(1) if hm else ""
    dims = [tuple(int(x) for x in s.split(",") if x) for s in re.findall(r"\[([0-9,]*)\]", hlo)]
    verify = any(69 in d for d in dims)
    rm = re.search(r"result\s*\{(.*)\}\s*\}?\s*$", blk, re.S)
    res = rm.group(1) if rm else blk
    kind = ",".join(sorted(set(re.findall(r"\b([a-z_]+)\s*\{", res)) - {"run_time"}))
    kinds[(verify, kind)] += 1
    if verify or n < 3:
        short = re.sub(r"\s+", " ", res)[:400]
        shapes = sorted(set(re.findall(r"[a-z0-9]+\[[0-9,]*\]", hlo.replace("\\n", " "))))[:12]
        print(f"--- block {n} verify={verify} kind={kind} shapes={shapes}\n    result: {short}")
    if verify:
        new, k = re.subn(r"split_k:\s*\d+", "split_k: 1", blk)
        edited += k
        pieces += [text[last:a], new]
        last = b
pieces.append(text[last:])
print("kinds:", dict(kinds))
print(f"split_k edits: {edited}")
open(dst, "w").write("".join(pieces))
