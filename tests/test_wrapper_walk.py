"""`wrapper_walk`: the bytes a generated wrapper's ``call`` holds, line by line, against sums done by hand on a
wrapper written in Inductor's form. (Against a real compiled step's counted peak: tests/test_compiled_plans.py.)"""

from ucudnn.torch.planning.wrapper_walk import walk_call

WRAPPER = """
import torch

def helper():
    buf9 = empty_strided_cpu((1000, ), (1, ), torch.float32)

class Runner:
    def call(self, args):
        primals_1, saved_1, tangents_1 = args
        args.clear()
        buf0 = empty_strided_cpu((4, 4), (4, 1), torch.float32)
        cpp_fused_0(tangents_1, saved_1, buf0)
        del tangents_1
        buf1 = torch.ops.aten.convolution_backward.default(buf0, saved_1, primals_1, [0], [True, True, False])
        del buf0
        del saved_1
        buf2 = buf1[0]
        assert_size_stride(buf2, (4, 8), (8, 1), 'torch.ops.aten.convolution_backward.default')
        buf3 = buf1[1]
        del buf1
        buf4 = buf2; del buf2  # reuse
        buf5 = reinterpret_tensor(buf4, (32, ), (1, ), 0)
        del buf4
        buf6 = empty_strided_cpu((2, 3), (1, 2), torch.float64)
        extern_kernels.mm(buf5, buf3, out=buf6)
        del buf6
        return (buf5, buf3, )

def benchmark_compiled_module():
    buf8 = empty_strided_cpu((1000, ), (1, ), torch.float32)
"""
SIZES = {"buf2": 128, "buf3": 32}  # the extern kernel's results, from the graph's layouts
FREEABLE = {"saved_1": 256, "tangents_1": 64}  # primals_1 is the caller's: not counted


def test_the_walk_sums_what_each_line_holds():
    walk = walk_call(WRAPPER, SIZES, FREEABLE)
    assert walk.live_at["buf0"] == 320 + 64
    # an extern kernel's results live beside its operands until the lines after it drop them
    assert walk.live_at["buf1"] == 256 + 64 + 128 + 32
    assert walk.peak == 480
    # elements bound, the tuple dropped, a buffer reused and viewed: 160 bytes all along; a 2x3 float64 buffer
    # allocated for an out= call holds its 48 bytes (6 elements, whatever its strides' order)
    assert walk.live_at["buf6"] == 160 + 48
    assert walk.live_at["buf5"] == walk.live_at["buf4"] == 160


def test_a_tuples_element_is_its_own_storage_by_its_index():
    # only the second element bound: its 32 bytes are held past the tuple, the first (unnamed, unsized) counts nothing
    walk = walk_call(WRAPPER.replace("        buf2 = buf1[0]\n", ""), SIZES, FREEABLE)
    assert walk.live_at["buf1"] == 256 + 64 + 32
    assert walk.live_at["buf6"] == 32 + 48


def test_inputs_not_freeable_and_code_outside_call_are_not_counted():
    walk = walk_call(WRAPPER, SIZES, {})
    assert walk.peak == 64 + 128 + 32  # buf0 beside the kernel's results; no input, no helper's buffers
