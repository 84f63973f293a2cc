"""Which leader epoch a worker obeys: one it can check, never one a message merely claims.

An epoch is *confirmed* by the leader's answer to one of this worker's heartbeats (a reply
on the worker's own inbox comes only from a responder that got the request, and only a
leader whose lease is surely valid answers). An announcement on `berth.leader`, or a
command, may move the obeyed epoch at most one step above the confirmed one (the usual
take-over, obeyed at once); anything higher is refused until a heartbeat answer confirms
it. A one-step claim no answer bears out is dropped by the next answer to a heartbeat sent
after it (docs/reliability.md). Pure logic over plain numbers; the agent supplies the
clock."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EpochView:
    confirmed: int = 0  # the newest epoch a heartbeat answer carried
    current: int = 0  # the epoch obeyed: commands of an older one are refused
    # When (CLOCK_MONOTONIC) `current` was raised above `confirmed` on a claim alone.
    claimed_at: float | None = None

    def answered(self, epoch: int, sent: float) -> None:
        """A heartbeat sent at `sent` was answered by the leader of `epoch`."""
        if epoch < self.confirmed:
            return  # a late answer of a leader since deposed
        self.confirmed = epoch
        if epoch >= self.current:
            self.current, self.claimed_at = epoch, None
        elif self.claimed_at is not None and sent >= self.claimed_at:
            # The leader of `epoch` held its lease after the claim was heard, so no leader
            # of the claimed epoch existed then: the claim was false.
            self.current, self.claimed_at = epoch, None

    def claimed(self, epoch: int, now: float) -> bool:
        """An announcement or command claims `epoch`; True if this raised the epoch obeyed."""
        if epoch <= self.current or epoch > self.confirmed + 1:
            return False
        self.current, self.claimed_at = epoch, now
        return True

    def obeys(self, epoch: int) -> bool:
        """Whether a command of `epoch` is obeyed (after `claimed` had its say)."""
        return self.current <= epoch <= max(self.current, self.confirmed + 1)

    def unchecked(self, epoch: int) -> bool:
        """A claim above what can be believed now: worth asking the leader at once."""
        return epoch > max(self.current, self.confirmed + 1)
