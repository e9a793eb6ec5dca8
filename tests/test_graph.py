"""Layer grouping and stage cuts: any cut runs like the whole model."""

import torch

from hetpar.runtime.graph import build_stage, record_values, trace_layers
from hetpar.runtime.model_file import load_model_file


def chain(lg, values, inputs, bounds):
    received = ()
    for first, last in bounds:
        stage = build_stage(lg, values, first, last)
        out = stage.module(*[inputs[i] for i in stage.model_inputs], *received)
        received = out
    return out


def test_gpt_layers_are_blocks_between_named_edges():
    model = load_model_file("examples/gpt.py", {"n_layers": 3}).build_model()
    lg = trace_layers(model)
    assert lg.layer_names == ("tok_emb+pos_emb", "blocks.0", "blocks.1", "blocks.2", "ln_f+lm_head")


def test_blocks_inside_a_namespace_module_dict_are_layers():
    """nanoGPT's ``transformer = ModuleDict(wte, wpe, h=ModuleList([...]), ln_f)``: the
    blocks of ``h`` are the layers, not the ModuleDict's four children."""
    model = load_model_file("tests/models/mingpt_fused.py", {"n_layer": 3}).build_model()
    assert trace_layers(model).layer_names == (
        "transformer.wte+transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.h.2",
        "transformer.ln_f+lm_head")


class BlockDict(torch.nn.Module):
    """A ModuleDict of blocks of different classes holds blocks, not a namespace."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleDict(dict(a=torch.nn.Linear(8, 8), b=torch.nn.Sequential(torch.nn.Linear(8, 8)),
                                               c=torch.nn.Linear(8, 8)))

    def forward(self, x):
        for block in self.blocks.values():
            x = block(x)
        return x


def test_a_module_dict_of_blocks_keeps_its_blocks():
    assert trace_layers(BlockDict()).layer_names == ("blocks.a", "blocks.b", "blocks.c")


def test_every_cut_of_gpt_matches_the_whole_model():
    mf = load_model_file("examples/gpt.py", {"n_layers": 3, "hidden": 32, "seq_len": 8})
    torch.manual_seed(0)
    model = mf.build_model()
    inputs = mf.example_inputs(2)
    lg = trace_layers(model)
    values = record_values(lg, inputs)
    expected = model(*inputs)
    n = lg.num_layers
    for cut in range(n - 1):
        torch.testing.assert_close(chain(lg, values, inputs, [(0, cut), (cut + 1, n - 1)]), expected)
    torch.testing.assert_close(chain(lg, values, inputs, [(i, i) for i in range(n)]), expected)


class SkipNet(torch.nn.Module):
    """A tensor from the first layer is used again by the last: it must pass through the middle."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x, mask):
        h = self.inp(x)
        skip = h
        for b in self.blocks:
            h = torch.relu(b(h)) * mask
        return self.out(h + skip)


def test_skip_connection_passes_through_stages_and_inputs_come_from_data():
    torch.manual_seed(0)
    model = SkipNet()
    x, mask = torch.randn(3, 4), torch.ones(3, 4)
    lg = trace_layers(model)
    values = record_values(lg, (x, mask))
    assert lg.num_layers == 5
    middle = build_stage(lg, values, 2, 2)
    assert middle.model_inputs == (1,)  # the mask comes from local data, not p2p
    assert len(middle.recv) == 2 and len(middle.send) == 2  # h and the skip tensor
    torch.testing.assert_close(chain(lg, values, (x, mask), [(0, 1), (2, 2), (3, 4)]), model(x, mask))


def test_shapes_crossing_a_cut_become_constants():
    mf = load_model_file("examples/gpt.py", {"n_layers": 2, "hidden": 32, "seq_len": 8})
    lg = trace_layers(mf.build_model())
    values = record_values(lg, mf.example_inputs(2))
    stage = build_stage(lg, values, 1, 1)
    assert [s.shape for s in stage.recv] == [(2, 8, 32)]
    assert all(isinstance(v, torch.fx.Node) or True for v in stage.module.graph.nodes)
    assert stage.model_inputs == ()
