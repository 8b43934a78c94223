"""Where a cold decode-heavy index build's time goes on this host (worker processes as the CLI)."""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks"))
T0 = time.perf_counter()
def log(msg): print(f"{time.perf_counter()-T0:7.3f} {msg}", flush=True)

def main():
    import analyzer.indexbuild as ib, analyzer.index as ix
    from analyzer.load import open_dump
    from common import evict
    ix.allow_index_processes()
    orig_tables, orig_write, orig_index_pass = ib._tables_of, ix._write_tables, ib.index_pass
    def tables_of(parts):
        log(f"tables_of start ({len(parts)} parts)"); r = orig_tables(parts); log("tables_of end"); return r
    def write(where, t, s):
        log(f"write start {where}"); orig_write(where, t, s); log("write end")
    def index_pass(pf, on_bytes=None):
        if pf.ref.nbytes > 32 << 20: log(f"big pass start {pf.ref.path[-40:]} {pf.ref.nbytes >> 20} MB")
        r = orig_index_pass(pf, on_bytes)
        if pf.ref.nbytes > 32 << 20: log(f"big pass done {pf.ref.path[-40:]}")
        return r
    ib._tables_of, ix._write_tables, ib.index_pass = tables_of, write, index_pass
    orig_start = ib._start_in_processes
    def start(small_refs, advance):
        done = [0]
        def adv(n):
            done[0] += 1
            if done[0] % 32 == 0 or done[0] == len(small_refs): log(f"small passes done: {done[0]}/{len(small_refs)}")
            advance(n)
        log("starting workers"); r = orig_start(small_refs, adv); log(f"workers started: {r[0] is not None}"); return r
    ib._start_in_processes = start
    w = sys.argv[1]
    for cold in (True, True, False):
        if cold: evict(w + "/ref", w + "/dec")
        global T0; T0 = time.perf_counter()
        log(f"=== {'cold' if cold else 'warm'} build")
        ix.load_indexes([open_dump(w + "/ref"), open_dump(w + "/dec")], rebuild=True, progress=False)
        log("end")

if __name__ == "__main__":
    main()
