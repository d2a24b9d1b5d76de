"""Matching the recorded collectives: the first call at which a group's members, or a send and its recv, disagree."""

from titan_fold.dryrun.record import P2P, _p2p_signature, _signature


def first_divergence(per_group: dict) -> dict | None:
    """The first call at which the members of a group disagree (kind, dtype, shape, count),
    or the first send without its recv (the n-th send from a to b against the n-th recv on
    b from a: dtype and shape)."""
    for (desc, ranks), by_rank in per_group.items():
        if desc == P2P:
            div = _p2p_divergence(ranks, by_rank)
            if div is not None:
                return div
            continue
        members = [r for r in ranks if r in by_rank]
        missing = [r for r in ranks if r not in by_rank]
        seqs = {r: by_rank[r] for r in members}
        if not members:
            continue
        ref_rank = members[0]
        longest = max(len(s) for s in seqs.values())
        for i in range(longest):
            sigs = {r: _signature(seqs[r][i]) if i < len(seqs[r]) else None for r in members}
            if len(set(sigs.values())) > 1:
                ref = sigs[ref_rank]
                odd = next(r for r in members if sigs[r] != ref)

                def show(r, seq=seqs, i=i):
                    c = seq[r][i] if i < len(seq[r]) else None
                    return "nothing (sequence ended)" if c is None else f"{c['op']} {c['shapes']} at {c['site']}"

                return {
                    "group": desc,
                    "ranks": list(ranks),
                    "call": i,
                    "rank": odd,
                    "reference_rank": ref_rank,
                    "rank_issued": show(odd),
                    "reference_issued": show(ref_rank),
                    "unrecorded_members": missing,
                }
    return None


def _p2p_divergence(pair: tuple[int, int], by_rank: dict) -> dict | None:
    def show(c):
        return "nothing (sequence ended)" if c is None else f"{c['op']} {c['shapes']} at {c['site']}"

    if any(r not in by_rank for r in pair):
        return None  # one of them not simulated (record_collectives' ranks)
    for src, dst in (pair, pair[::-1]):
        sends = [c for c in by_rank.get(src, []) if c["op"] == "send" and c["peer"] == dst]
        recvs = [c for c in by_rank.get(dst, []) if c["op"] == "recv" and c["peer"] == src]
        for i in range(max(len(sends), len(recvs))):
            send = sends[i] if i < len(sends) else None
            recv = recvs[i] if i < len(recvs) else None
            if send is None or recv is None or _p2p_signature(send) != _p2p_signature(recv):
                return {
                    "group": f"{P2P} {src}->{dst}",
                    "ranks": [src, dst],
                    "call": i,
                    "rank": src,
                    "reference_rank": dst,
                    "rank_issued": show(send),
                    "reference_issued": show(recv),
                    "unrecorded_members": [],
                }
    return None
