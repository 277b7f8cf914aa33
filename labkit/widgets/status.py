"""The dashboard's status line: what happened in the step on screen.

One sentence per step, from the lockstep model's record of it (each rank's prefill and
decode work and its stall) and the requests the engine finished by its end — so the
line follows the *show step* slider, not the engine's latest state.
"""

from __future__ import annotations

import html


def describe_step(engine, lockstep, step: int) -> str:
    """HTML: the deployment, then step `step` (0: before the first) of the run."""
    head = (f"<b>{html.escape(engine.model.name)}</b> &middot; <b>{engine.layout.text}</b> on "
            f"{engine.gpus} x {html.escape(engine.hardware.name)}")
    done = lockstep.steps_done
    if step == 0:
        return f"{head} &mdash; before the first step ({done} steps computed so far)"
    rows = lockstep.step(step)
    start, duration = float(rows["start_s"][0]), float(rows["duration_s"][0])
    end = start + duration
    finished = sum(1 for r in engine.requests.values()
                   if r.finish_s is not None and r.finish_s <= end)
    prefilling = rows["prefill_tokens"] > 0
    parts = [f"{int(rows['num_decode_reqs'].sum())} requests decoding"]
    if prefilling.any():
        parts.append(f"{int(prefilling.sum())} of {len(rows['rank'])} rank(s) prefilling "
                     f"{int(rows['prefill_tokens'].sum())} tokens")
    stall = rows["stall_s"]
    if stall.max() > 0:
        worst = int(rows["rank"][stall.argmax()])
        parts.append(f"max stall {1e3 * stall.max():.2f} ms (rank {worst})")
    return (f"{head} &mdash; step {step} of {done}: t = {start:.3f} s, lasting "
            f"{1e3 * duration:.2f} ms; {', '.join(parts)}; {finished} calls done by its end")
