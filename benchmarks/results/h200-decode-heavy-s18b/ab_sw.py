import sys, os, time, subprocess
sys.path.insert(0, os.path.join(os.getcwd(), 'benchmarks'))
from common import evict, files_under
W = os.environ.get('W', '/tmp/ddd'); ref, dec = W + '/ref', W + '/dec'
files = files_under(ref) + files_under(dec)
N = int(os.environ.get('N', 6)); sws = sys.argv[1:]
res = {s: [] for s in sws}; cat = []
for i in range(N):
    evict(ref, dec); s = time.perf_counter(); subprocess.run(['cat', *files], stdout=subprocess.DEVNULL); cat.append(time.perf_counter() - s)
    for sw in sws:
        evict(ref, dec); s = time.perf_counter()
        subprocess.run(['python3', os.path.join(os.getcwd(), 'sw_cli.py'), 'index', ref, dec, '--rebuild'], cwd=os.getcwd(), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, 'SW': sw})
        res[sw].append(time.perf_counter() - s)
med = lambda x: sorted(x)[len(x) // 2]
print('cat', [round(x, 2) for x in cat], round(med(cat), 3))
for sw in sws: print('switch', sw, [round(x, 2) for x in res[sw]], 'median', round(med(res[sw]), 3), 'ratio', round(med(cat) / med(res[sw]), 3))
