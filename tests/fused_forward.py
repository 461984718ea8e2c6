"""A model's forward before and after a fusion of fastppl.accel, for the fused kernels' tests in any folder."""
import torch


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def plain_and_fused(model, fuse, unfuse, device: torch.device, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The final hidden states of 3 rows of 40 random ids, plain and then with fuse(model) applied (undone after);
    packed: two documents a row, whose positions restart and which do not attend to each other."""
    ids = torch.randint(0, 50257, (3, 40), device=device, generator=torch.Generator(device=device).manual_seed(1))
    args = ()
    if packed:
        positions = torch.cat([torch.arange(15), torch.arange(25)]).to(device).expand(3, -1)
        documents = torch.cat([torch.zeros(15), torch.ones(25)]).long().to(device).expand(3, -1)
        args = (positions, documents)
    with torch.inference_mode():
        plain = model(ids, *args)
        assert fuse(model)
        fused = model(ids, *args)
        unfuse(model)
    return plain, fused
