# ruff: noqa  (a measurement script kept as it was run, for the record)
"""The front end's side of the n128_logprobs row, offline: 200 engine steps of 2 x 128 sequences with 21 logprobs
applied to ClientStreams (wire-decoded as in the server), collected, then the response built as completions.py
does (in a thread). Reports the event loop's longest gaps, GC pauses and RSS at each phase."""
import asyncio, gc, os, random, sys, time, threading, ctypes
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, os.getcwd())
from atlas.engine import wire
from atlas.engine.engine_client import ClientStream
from atlas.engine.tokenizer import Tokenizer
from atlas.sampling_params import SamplingParams
from atlas.server.logprobs import TokenText
from atlas.server import protocol as P
from atlas.server.completions import Completions
from atlas.server.frontend import PromptInfo
from atlas.processes import resident_bytes, give_back_memory

STEPS = int(os.environ.get("STEPS", 200)); N = 128; TOP = 20
def rss(): return resident_bytes(os.getpid()) / 2**20
gcp = []
def cb(phase, info, t=[0]):
    if phase == "start": t[0] = time.perf_counter()
    else: gcp.append((info["generation"], time.perf_counter() - t[0]))
gc.callbacks.append(cb)
if os.environ.get("FREEZE"): gc.collect(); gc.freeze()

class FakeClient:
    def _forget(self, s): pass
class Front:
    pass

async def main():
    tok = Tokenizer.from_pretrained("atlas/assets/default-model") if hasattr(Tokenizer, "from_pretrained") else Tokenizer("atlas/assets/default-model")
    front = Front(); front.token_text = TokenText(tok); front.info = None
    comp = Completions(front)
    if os.environ.get("PREWARM"):
        for t in range(3000): front.token_text.text(t)
    loop = asyncio.get_running_loop()
    params = SamplingParams(n=N, max_tokens=STEPS, logprobs=TOP)
    streams = [ClientStream(FakeClient(), f"r{i}", loop, [64 + i], params, None) for i in range(2)]
    gaps = []
    stop = False
    async def ticker():
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.002)
            now = time.perf_counter(); gaps.append((now - last, phase[0])); last = now
    phase = ["gen"]
    tk = asyncio.ensure_future(ticker())
    async def last(s):
        out = None
        async for out in s: pass
        return out
    work = asyncio.gather(*(last(s) for s in streams))
    import tracemalloc
    if os.environ.get("TM"): tracemalloc.start(3); snap0 = tracemalloc.take_snapshot()
    def mstats(tag):
        import io, contextlib, re
        libc = ctypes.CDLL("libc.so.6")
        class MI(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
        libc.mallinfo2.restype = MI
        mi = libc.mallinfo2()
        r, w = os.pipe(); saved = os.dup(2); os.dup2(w, 2); sys._debugmallocstats(); os.dup2(saved, 2); os.close(w)
        txt = os.read(r, 1 << 20).decode(); os.close(r)
        ar = re.search(r"# arenas allocated current\s*=\s*([\d,]+)", txt).group(1)
        used = re.search(r"# bytes in allocated blocks\s*=\s*([\d,]+)", txt).group(1)
        print(f"[{tag}] pymalloc arenas {ar}, bytes in blocks {used}; malloc heap {mi.arena/2**20:.0f} MiB, in use {mi.uordblks/2**20:.0f}, free {mi.fordblks/2**20:.0f}, mmap {mi.hblkhd/2**20:.0f}")
    mstats("start")
    r0 = rss(); print(f"rss start {r0:.0f} MiB, blocks {sys.getallocatedblocks()}")
    rnd = random.Random(0)
    vocab = 3000
    for step in range(STEPS):
        outs = []
        for i, s in enumerate(streams):
            seqs = []
            for j in range(N):
                t = rnd.randrange(vocab)
                ent = {t: (-0.5, 1, None)}
                for k in range(TOP):
                    ent[rnd.randrange(vocab)] = (-1.0 - k, k + 1, None)
                fin = "length" if step == STEPS - 1 else None
                seqs.append(wire.SeqDelta(j, step, [t], step, "x", [ent], -1.0, fin))
            outs.append(wire.RequestDelta(s.request_id, seqs, step == STEPS - 1))
        msg = wire.front_end_decoder.decode(wire.encoder.encode(wire.Step(outs)))
        for d in msg.outputs:
            streams[int(d.request_id[1:])].apply(d)
        await asyncio.sleep(0.005)
    finals = await work
    r1 = rss(); print(f"rss after generation {r1:.0f} MiB (+{r1-r0:.0f})")
    import collections
    objs = gc.get_objects(); c = collections.Counter(type(o).__name__ for o in objs)
    print("tracked", len(objs), c.most_common(8)); del objs, c
    phase[0] = "build"
    req = P.CompletionRequest(model="m", prompt=["a", "b"], n=N, max_tokens=STEPS, logprobs=TOP)
    prompts = [PromptInfo("a", [64], params), PromptInfo("b", [65], params)]
    pool = ThreadPoolExecutor(1)
    t0 = time.perf_counter()
    build = getattr(comp, "completion_pieces", None) or comp.completion_response
    resp = await loop.run_in_executor(pool, build, req, "m", "cmpl-x", 0, prompts, finals, False)
    t1 = time.perf_counter()
    phase[0] = "after"
    body = b"".join(resp) if isinstance(resp, list) else resp.body; print(f"built in {t1-t0:.2f} s, body {len(body)/1e6:.1f} MB; rss {rss():.0f} MiB")
    body = b""
    del resp, finals, streams, work, s, d, msg, outs, seqs, ent
    await asyncio.sleep(0.1)
    gc.collect()
    r2 = rss(); print(f"rss after free+collect {r2:.0f} MiB (+{r2-r0:.0f})")
    give_back_memory()
    r3 = rss(); print(f"rss after main-thread trim {r3:.0f} MiB (+{r3-r0:.0f})")
    await loop.run_in_executor(pool, give_back_memory)
    r4 = rss(); print(f"rss after pool trim {r4:.0f} MiB (+{r4-r0:.0f}), blocks {sys.getallocatedblocks()}, gaps {len(gaps)}")
    stop = True; await tk
    mstats("end")
    if os.environ.get("TM"):
        snap1 = tracemalloc.take_snapshot()
        for st in snap1.compare_to(snap0, "traceback")[:12]:
            print(st.count_diff, st.size_diff, "\n   ", "\n    ".join(str(f) for f in st.traceback))
    if os.environ.get("MSTATS"):
        sys._debugmallocstats()
        ctypes.CDLL("libc.so.6").malloc_stats()
    for ph in ("gen", "build"):
        g = sorted((x for x, p in gaps if p == ph), reverse=True)
        print(ph, "loop gaps (s), longest:", [round(x, 3) for x in g[:8]], "sum>50ms", round(sum(x for x in g if x > .05), 2))
    print("gc pauses > 20 ms:", [(gen, round(d, 3)) for gen, d in gcp if d > 0.02])
    if os.environ.get("DUMP"):
        open(os.environ["DUMP"], "wb").write(body)

asyncio.run(main())
