"""Every way of writing a module's weights that the tests change them by: a policy with a frozen
backbone, a trained head and a buffer written in forward, and the routes (``write``) by which its
backbone changes, each of which a copy must reach byte for byte, on the trainer and in a reader."""

import io
import threading

import numpy as np
import torch


class Policy(torch.nn.Module):
    """A frozen backbone (2 MB) with a trained head, a buffer written in forward, and a small bias."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(512, 1024)
        self.head = torch.nn.Linear(1024, 64)
        self.norm = torch.nn.BatchNorm1d(64)
        self.backbone.requires_grad_(False)

    def forward(self, x):
        return self.norm(self.head(self.backbone(x)))


def write(policy: Policy, how: str, k: float) -> None:
    """Change the frozen backbone's weights the way ``how`` says (to values that hold ``k``)."""
    w = policy.backbone.weight
    if how == "in place":
        with torch.no_grad():
            w[3, 5] = k
    elif how == ".data":
        w.data[7, 1] = k
    elif how == "numpy":
        w.detach().numpy()[11, 2] = k
    elif how == "load_state_dict":
        state = {n: t.clone() for n, t in policy.backbone.state_dict().items()}
        state["weight"][0, 0] = k
        policy.backbone.load_state_dict(state)
    elif how == "swapped":
        policy.backbone.weight.data = torch.full_like(w, k)  # new memory: what was tracked moved
    elif how == "unfrozen and stepped":
        w.requires_grad_(True)
        optimizer = torch.optim.Adam([w], lr=0.5)
        policy.backbone(torch.ones(2, 512)).sum().backward()
        optimizer.step()
    elif how == "fused adam":
        w.requires_grad_(True)
        optimizer = torch.optim.Adam([w], lr=0.5, fused=True)
        w.grad = torch.ones_like(w)
        optimizer.step()
    elif how == "foreach adam":  # one kernel call over the list of tensors
        w.requires_grad_(True)
        optimizer = torch.optim.Adam([w], lr=0.5, foreach=True)
        w.grad = torch.ones_like(w)
        optimizer.step()
    elif how == "another thread":
        thread = threading.Thread(target=lambda: w.data.add_(k))
        thread.start()
        thread.join()
    elif how == "readinto":
        io.BytesIO(np.full(256, k, dtype=np.float32).tobytes()).readinto(w.detach().numpy().reshape(-1)[:256].data)
    elif how == "copy_ from a state dict tensor":
        policy.backbone.state_dict()["weight"][5].copy_(torch.full((512,), k))
    elif how == "vector_to_parameters":
        vector = torch.nn.utils.parameters_to_vector(policy.backbone.parameters()) + k
        torch.nn.utils.vector_to_parameters(vector, policy.backbone.parameters())
    elif how == "buffer in forward":  # BatchNorm's running statistics (small: compared, not tracked)
        policy.train()
        policy(torch.randn(8, 512) * k)
    else:
        raise ValueError(how)


ROUTES = [
    "in place", ".data", "numpy", "load_state_dict", "swapped", "unfrozen and stepped", "fused adam", "foreach adam",
    "another thread", "readinto", "copy_ from a state dict tensor", "vector_to_parameters", "buffer in forward",
]  # fmt: skip
