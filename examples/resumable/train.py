"""Trains STEPS steps; saves a checkpoint in BERTH_TASK_DIR on SIGTERM (the timeout) and
after every step, and resumes from it on the next attempt."""

import json
import os
import signal
import sys
import time

import trainer

CHECKPOINT = os.path.join(os.environ.get("BERTH_TASK_DIR", "."), "checkpoint.json")
STEPS = int(os.environ.get("STEPS", "30"))
PAUSE = float(os.environ.get("STEP_SECONDS", "0.25"))


def save(step: int, state: float) -> None:
    tmp = CHECKPOINT + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step, "state": state}, f)
    os.replace(tmp, CHECKPOINT)  # a checkpoint is whole or absent


def main() -> None:
    step, state = 0, 0.0
    if os.path.exists(CHECKPOINT):
        with open(CHECKPOINT) as f:
            saved = json.load(f)
        step, state = saved["step"], saved["state"]
    print(f"attempt {os.environ.get('BERTH_ATTEMPT_ID')} (retry "
          f"{os.environ.get('BERTH_RETRY_COUNT')}): starting at step {step}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (save(step, state), sys.exit(143)))
    while step < STEPS:
        state = trainer.train_step(state, step)
        step += 1
        save(step, state)
        time.sleep(PAUSE)
    print(f"done: {STEPS} steps, state {state:.4f}")


if __name__ == "__main__":
    main()
