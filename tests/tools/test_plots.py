"""relpos plot: the numbers come from relpos, the images are written and not blank."""

import matplotlib.image as mpimg
import pytest
import torch

import relpos
from relpos.tools import plots
from relpos.tools.cli import main

from cat_sat import BIASED, STANDARD


@pytest.mark.parametrize(
    "args",
    [
        ["buckets"],
        ["buckets", "--causal", "--strategy", "quadratic", "--num-buckets", "16", "--max-distance", "40"],
        ["bias", "--kind", "t5"],
        ["bias", "--kind", "window2d"],
        ["bias", "--kind", "clipped", "--max-distance", "4"],
        ["bias", "--kind", "alibi", "--causal"],
        ["bias", "--kind", "log_decay", "--scale", "0.5"],
        ["attention"],
    ],
)
def test_cli_writes_a_non_trivial_png(tmp_path, capsys, args):
    out = tmp_path / "plot.png"
    assert main(["plot", *args, "-o", str(out)]) == 0
    image = mpimg.imread(out)
    assert image.shape[0] > 300 and image.shape[1] > 300
    assert image[..., :3].std() > 0.05  # a heatmap with labels, not a blank canvas
    assert "wrote" in capsys.readouterr().out


def test_bias_matrices_come_from_relpos():
    alibi = plots.bias_matrix("alibi", 6, causal=True, slope=0.5)
    assert torch.equal(alibi, relpos.ALiBi(1, slopes=[0.5]).materialize(6, 6)[0, 0])
    log_decay = plots.bias_matrix("log_decay", 5, scale=0.3)
    assert torch.equal(log_decay, relpos.LogDecayBias(0.3).materialize(5, 5)[0, 0])
    window = plots.bias_matrix("window2d", 9)
    assert window.shape == (9, 9) and torch.equal(torch.diagonal(window), window[0, 0].expand(9))
    with pytest.raises(ValueError, match="square number"):
        plots.bias_matrix("window2d", 10)


def test_attention_panels_are_the_worked_example():
    standard, biased = plots.worked_example_weights(0.3)
    assert torch.allclose(standard, torch.tensor(STANDARD, dtype=torch.float64), atol=5e-5)
    assert torch.allclose(biased, torch.tensor(BIASED, dtype=torch.float64), atol=5e-5)


def test_bad_plot_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plot", "bias", "--kind", "fourier", "-o", "x.png"])
    assert info.value.code == 2 and "kind must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("argv,phrase", [
    (["plot", "bias", "--length", "100000"], "past the plots' limit of 1024"),
    (["plot", "buckets", "--length", "5000"], "past the plots' limit of 1024"),
    (["plot", "buckets", "--num-buckets", "100000"], "num_buckets=100000 is past the plots' limit"),
])
def test_plot_sizes_are_bounded_before_any_work(tmp_path, capsys, monkeypatch, argv, phrase):
    def work(*args, **kwargs):
        raise AssertionError("the plot began its work before refusing the size")

    for name in ("relative_position_bucket", "relative_positions"):  # what a plot computes
        monkeypatch.setattr(plots, name, work)
    monkeypatch.setattr(plots.registry.Encoding, "create", work)  # building any encoding's module
    with pytest.raises(SystemExit) as info:
        main([*argv, "-o", str(tmp_path / "p.png")])
    assert info.value.code == 2 and phrase in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def _bucket_map_colours(monkeypatch, tmp_path, num_buckets: int) -> list[tuple]:
    """The colours ``relpos plot buckets`` gives the buckets, read from the drawn figure's colour map."""
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figure to inspect it
    plots.plot_buckets(tmp_path / "b.png", num_buckets=num_buckets, max_distance=4 * num_buckets, length=8)
    (fig,) = kept
    cmap = fig.axes[0].images[0].cmap
    colours = [tuple(round(255 * c) for c in cmap(b)[:3]) for b in range(num_buckets)]  # 8-bit RGB, as saved
    monkeypatch.undo()
    plt.close(fig)
    return colours


@pytest.mark.parametrize("num_buckets", [32, 128])
def test_every_bucket_has_its_own_colour(monkeypatch, tmp_path, num_buckets):
    colours = _bucket_map_colours(monkeypatch, tmp_path, num_buckets)
    assert len(set(colours)) == num_buckets  # T5's 32 and 128: no two buckets share a colour (was 20)
    assert all(a != b for a, b in zip(colours, colours[1:]))


@pytest.mark.parametrize("count", [1, 18, 19, 25, 60, 256])
def test_palettes_are_pairwise_distinct(count):
    for colours in (plots.bucket_colours(count), plots.category_colours(count)):
        assert len(colours) == count and len({tuple(round(255 * c) for c in rgb) for rgb in colours}) == count
    with pytest.raises(ValueError, match="num_buckets must be positive, got 0"):
        plots.bucket_colours(0)
