"""Semi-SFL's two-level memory queue of teacher projections (the queue Q of Eq. 5). Plain torch."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FeatureQueue"]


class FeatureQueue:
    """Semi-SFL's two-level memory queue Q of teacher projections (Q of Eq. 5, Sec. III; the levels
    and their sizes are the library's choice: the paper gives no sizes).

    * Level 1: labeled projections with ground-truth labels, confidence 1,
      capacity ``labeled_size`` (1024).
    * Level 2: FIFO of unlabeled teacher projections with pseudo-labels and
      confidences, from all clients, capacity ``unlabeled_size`` (4096).

    Both levels are FIFO ring buffers of fixed capacity: when full, the oldest
    entries are overwritten. A batch larger than the capacity keeps only its
    last ``capacity`` rows.

    "Dequeued at a lower frequency" (level 1): level 1 takes only every
    ``labeled_every``-th call of :meth:`enqueue_labeled` (calls 0,
    ``labeled_every``, ``2*labeled_every``, ...); the others are ignored.
    The default ``labeled_every=1`` already refreshes level 1 far more slowly
    than level 2 at the default sizes: a round pushes K_s*B_l = 50*64 labeled
    rows into 1024 slots (about 3 refreshes) but K_u*N_h*d = 50*10*64 unlabeled
    rows into 4096 slots (about 8 refreshes). Raise ``labeled_every`` to slow
    it further.

    Stored tensors are detached copies on ``device``. :meth:`tensors` returns
    ``(z, y, conf)``: level 1 first, then level 2, each oldest-first. Entries are
    stored as given; :func:`supcon_loss` normalises them by default.
    """

    def __init__(
        self,
        dim: int,
        labeled_size: int = 1024,
        unlabeled_size: int = 4096,
        *,
        labeled_every: int = 1,
        device=None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if dim <= 0 or labeled_size < 0 or unlabeled_size < 0 or labeled_every < 1:
            raise ValueError("dim > 0, sizes >= 0 and labeled_every >= 1 are required")
        self.dim = int(dim)
        self.labeled_size = int(labeled_size)
        self.unlabeled_size = int(unlabeled_size)
        self.labeled_every = int(labeled_every)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self._z = [
            torch.zeros(self.labeled_size, self.dim, device=device, dtype=dtype),
            torch.zeros(self.unlabeled_size, self.dim, device=device, dtype=dtype),
        ]
        self._y = [
            torch.zeros(self.labeled_size, dtype=torch.long, device=device),
            torch.zeros(self.unlabeled_size, dtype=torch.long, device=device),
        ]
        self._c = [
            torch.ones(self.labeled_size, device=device, dtype=dtype),
            torch.zeros(self.unlabeled_size, device=device, dtype=dtype),
        ]
        self._ptr = [0, 0]
        self._count = [0, 0]
        self._labeled_calls = 0

    # -- basic properties --------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._z[0].device

    def __len__(self) -> int:
        return self._count[0] + self._count[1]

    def level_sizes(self) -> tuple[int, int]:
        """Number of stored entries in (level 1, level 2)."""
        return self._count[0], self._count[1]

    def to(self, device) -> "FeatureQueue":
        for lst in (self._z, self._y, self._c):
            for i in range(2):
                lst[i] = lst[i].to(device)
        return self

    # -- writing -----------------------------------------------------------
    def _push(self, level: int, z: Tensor, y: Tensor, conf: Tensor) -> None:
        cap = self._z[level].shape[0]
        if cap == 0:
            return
        z = z.detach().reshape(-1, self.dim)
        y = y.detach().reshape(-1)
        conf = conf.detach().reshape(-1)
        if not (z.shape[0] == y.shape[0] == conf.shape[0]):
            raise ValueError("z, labels and confidences must have the same length")
        if z.shape[0] > cap:
            z, y, conf = z[-cap:], y[-cap:], conf[-cap:]
        n = z.shape[0]
        if n == 0:
            return
        dev = self.device
        idx = (self._ptr[level] + torch.arange(n, device=dev)) % cap
        self._z[level][idx] = z.to(device=dev, dtype=self._z[level].dtype)
        self._y[level][idx] = y.to(device=dev, dtype=torch.long)
        self._c[level][idx] = conf.to(device=dev, dtype=self._c[level].dtype)
        self._ptr[level] = (self._ptr[level] + n) % cap
        self._count[level] = min(cap, self._count[level] + n)

    def enqueue_labeled(self, z: Tensor, y: Tensor) -> bool:
        """Push labeled teacher projections with true labels into level 1.

        Only every ``labeled_every``-th call writes; returns whether it did.
        """
        write = self._labeled_calls % self.labeled_every == 0
        self._labeled_calls += 1
        if write:
            ones = torch.ones(z.shape[0], device=z.device, dtype=self._c[0].dtype)
            self._push(0, z, y, ones)
        return write

    def enqueue_unlabeled(self, z: Tensor, yhat: Tensor, conf: Tensor) -> None:
        """Push unlabeled teacher projections, pseudo-labels and confidences into level 2."""
        self._push(1, z, yhat, conf)

    # -- reading -----------------------------------------------------------
    def _ordered(self, level: int) -> tuple[Tensor, Tensor, Tensor]:
        cap, cnt = self._z[level].shape[0], self._count[level]
        if cnt < cap:
            idx = torch.arange(cnt, device=self.device)
        else:
            idx = (self._ptr[level] + torch.arange(cap, device=self.device)) % cap
        return self._z[level][idx], self._y[level][idx], self._c[level][idx]

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(z [Q, d], y [Q], conf [Q])``: level 1 then level 2, oldest first."""
        parts = [self._ordered(0), self._ordered(1)]
        return tuple(torch.cat([p[i] for p in parts], dim=0) for i in range(3))  # type: ignore[return-value]

    # -- checkpointing -----------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "dim": self.dim,
            "labeled_size": self.labeled_size,
            "unlabeled_size": self.unlabeled_size,
            "labeled_every": self.labeled_every,
            "z": [t.detach().cpu().clone() for t in self._z],
            "y": [t.detach().cpu().clone() for t in self._y],
            "conf": [t.detach().cpu().clone() for t in self._c],
            "ptr": list(self._ptr),
            "count": list(self._count),
            "labeled_calls": self._labeled_calls,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("dim", "labeled_size", "unlabeled_size"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(f"queue {key} mismatch: {state[key]} != {getattr(self, key)}")
        dev = self.device
        self.labeled_every = int(state.get("labeled_every", self.labeled_every))
        self._z = [t.to(device=dev, dtype=self._z[i].dtype).clone() for i, t in enumerate(state["z"])]
        self._y = [t.to(device=dev, dtype=torch.long).clone() for t in state["y"]]
        self._c = [t.to(device=dev, dtype=self._c[i].dtype).clone() for i, t in enumerate(state["conf"])]
        self._ptr = [int(v) for v in state["ptr"]]
        self._count = [int(v) for v in state["count"]]
        self._labeled_calls = int(state["labeled_calls"])
