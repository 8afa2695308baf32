"""Where the fused merge's tail goes: per-CTA clock64/globaltimer stamps (SPLITKV_TRACE build)."""
import statistics as st
import sys
import torch
from splitkv_tune import ops, tunables
from splitkv_tune.tunables import Shape

GHZ = float(sys.argv[1]) if len(sys.argv) > 1 else 1.98
dev = "cuda"


def tile_stats(t, tiles):
    tile = torch.arange(t.shape[0]) % tiles
    tails, same = [], []
    for i in range(tiles):
        c = t[tile == i]
        merger = c[c[:, 6] == 1][0]
        tails.append((int(merger[8]) - int(c[:, 10].max())) / 1e3)
        same.append(float(int(merger[10]) == int(c[:, 10].max())))
    return dict(tile_tail=st.median(tails), merger_loop_last=sum(same) / len(same))

for B, Hkv, Sk, S in [(1, 8, 64, 2), (1, 8, 64, 16), (1, 8, 1024, 16), (1, 32, 4096, 4), (4, 8, 4096, 4), (1, 8, 16384, 15)]:
    shape = Shape("bf16", 128, B, 32, Hkv, 1, Sk, False)
    nsets = max(1, int(200e6 // (2 * B * Sk * Hkv * 128 * 2)) + 1)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, 1, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
    kvs = [(torch.randn(B, Sk, Hkv, 128, device=dev, dtype=torch.bfloat16, generator=g),
            torch.randn(B, Sk, Hkv, 128, device=dev, dtype=torch.bfloat16, generator=g)) for _ in range(min(nsets, 8))]
    nbytes = tunables.workspace_bytes(shape, S)
    ncta = B * Hkv * S * tunables.num_m_blocks(shape)
    ws = torch.zeros(nbytes + ncta * 12 * 8 + 4096, dtype=torch.uint8, device=dev)
    rows = []
    for it in range(40):
        k, v = kvs[it % len(kvs)]
        ws[nbytes:].zero_()
        out = ops.splitkv_attention(q, k, v, num_splits=S, block_kv=64, reduce_threads=128, split_policy="blocks",
                                    merge="fused", workspace=ws)
        torch.cuda.synchronize()
        if it < 10:
            continue
        t = ws[nbytes:nbytes + ncta * 96].view(torch.int64).view(ncta, 12).cpu()
        g0 = int(t[:, 1].min())
        last = t[t[:, 6] == 1]
        rows.append(dict(
            span=(int(t[:, 8].max()) - g0) / 1e3,
            start_spread=(int(t[:, 1].max()) - g0) / 1e3,
            loop_end_max=(int(t[:, 10].max()) - g0) / 1e3,
            loop_end_min=(int(t[:, 10].min()) - g0) / 1e3,
            loop_cyc=st.median((last[:, 3] - last[:, 0]).tolist()) / GHZ / 1e3,
            sync1=st.median((last[:, 4] - last[:, 3]).tolist()) / GHZ / 1e3,
            atomic=st.median((last[:, 5] - last[:, 4]).tolist()) / GHZ / 1e3,
            sync_or=st.median((last[:, 9] - last[:, 5]).tolist()) / GHZ / 1e3,
            merge=st.median((last[:, 7] - last[:, 9]).tolist()) / GHZ / 1e3,
            nonlast_exit=st.median(((t[t[:, 6] == 0][:, 7] - t[t[:, 6] == 0][:, 5])).tolist()) / GHZ / 1e3,
            tail_after_last_loop=(int(t[:, 8].max()) - int(t[:, 10].max())) / 1e3,
            **tile_stats(t, ncta // S),
        ))
    med = {k: st.median(r[k] for r in rows) for k in rows[0]}
    diffs = sorted(set(int(x) % 1000 for x in t[:, 1].tolist()))[:5]
    print(f"B{B} Hkv{Hkv} Sk{Sk} S{S} ({ncta} CTAs): " + "  ".join(f"{k}={v:.2f}" for k, v in med.items()) + f"  gt_mod1000={diffs}")
