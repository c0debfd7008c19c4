# ruff: noqa  (a measurement script kept as it was run, for the record)
import os, sys, time
def tree():
    ch = {}
    for e in os.listdir('/proc'):
        if e.isdigit():
            try:
                s = open(f'/proc/{e}/stat').read()
                ppid = int(s.rpartition(')')[2].split()[1])
            except Exception: continue
            ch.setdefault(ppid, []).append(int(e))
    return ch
def rss(p):
    try:
        for l in open(f'/proc/{p}/status'):
            if l.startswith('VmRSS'): return int(l.split()[1])//1024
    except Exception: return None
def name(p):
    try: return open(f'/proc/{p}/cmdline').read().replace('\0',' ')[:60]
    except Exception: return '?'
# find root: process with 'atlas.cli serve'
root = int(sys.argv[2]) if len(sys.argv) > 2 else None
while root is None:
    for e in os.listdir('/proc'):
        if e.isdigit() and 'atlas.cli serve' in name(e) and 'python' in name(e):
            root = int(e); break
    time.sleep(0.5)
out = open(sys.argv[1], 'w')
t0 = time.time()
while os.path.exists(f'/proc/{root}'):
    ch = tree(); todo=[root]; row=[]
    while todo:
        p=todo.pop(); todo+=ch.get(p,[]); row.append(f'{p}:{rss(p)}')
    out.write(f'{time.time()-t0:.1f} ' + ' '.join(row) + '\n'); out.flush()
    time.sleep(0.5)
