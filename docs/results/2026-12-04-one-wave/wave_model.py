"""The wave model of docs/benchmarks.md 7t (analysis only, not used by the library): thread blocks dispatched in
grid order (row blocks fastest) to 132 SMs, one at a time each, greedily; a block costs a + its key blocks (x r for
the light row block), in units of b us. Fits a, r, b per shape to calls A and B's kernel-alone times and prints
measured against predicted. Run from this folder: python wave_model.py"""
import collections, heapq, json
from pathlib import Path
import numpy as np
def cdiv(a,b): return -(-a//b)
SHAPES={("padded-8b",16384):(18,2),("padded-8b",32768):(18,2),("llama3-8b",32768):(8,3)}
def costs(S, heads, rbs, s, l, a, r, bk=128, order="rows"):
    def chunks(n):
        ch = cdiv(cdiv(S, n), bk)*bk
        return [cdiv(max(0, min(i*ch+ch, S)-i*ch), bk) for i in range(n)]
    full = chunks(s); lt = chunks(l) if l else full
    out=[]
    for h in range(heads):
        for i in range(s):
            for rb in range(rbs):
                last = rb == rbs-1
                n = (lt[i] if i < len(lt) else 0) if last else full[i]
                out.append(0.0 if n == 0 else a + n*(r if last else 1.0))
    return out
def makespan(cs, slots=132):
    heap=[0.0]*slots
    for c in cs:
        if c == 0: continue
        t=heapq.heappop(heap); heapq.heappush(heap,t+c)
    return max(heap)
agg=collections.defaultdict(list)
for name in ("callA_light1", "callA_light2", "callB_grid1", "callB_grid2"):
    for r in json.load(open(Path(__file__).with_name(name + ".json")))["sweep_mosaic"]:
        if r["impl"] == "mosaic" and "us" in r:
            c = r["config"]
            agg[(r["model"], r["S"], c["num_splits"], c.get("light_splits") or 0)].append(r["us"])
by={}
for (m,S,s,l),v in agg.items(): by.setdefault((m,S),[]).append((s,l,float(np.mean(v))))
for key,pts in by.items():
    heads,rbs=SHAPES[key]; S=key[1]
    best=None
    for a in np.arange(0,30,0.5):
        for r in np.arange(0.4,1.01,0.02):
            x=np.array([makespan(costs(S,heads,rbs,s,l,a,r)) for s,l,_ in pts]); y=np.array([p[2] for p in pts])
            b=(x@y)/(x@x); e=np.sqrt(np.mean((b*x-y)**2))
            if best is None or e<best[0]: best=(e,a,r,b)
    e,a,r,b=best
    print(key, "a=%.1f key-blocks r=%.2f b=%.3f us/key-block  rmse %.1f us"%(a,r,b,e))
    for s,l,y in sorted(pts, key=lambda p:p[2]):
        print("   s=%2d l=%2d meas %6.1f pred %6.1f"%(s,l,y,b*makespan(costs(S,heads,rbs,s,l,a,r))))
