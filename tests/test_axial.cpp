// Axial attention: equal to two passes of attention done by hand on
// contiguous copies (rows, then columns over the first pass's output), the
// fused float32 path against float64, finite-difference gradients in double,
// a 1 × 1 image, typed errors.
#include "mha/variants/axial.h"
#include "variants_testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

// (…, a, b, x) → (…, b, a, x) as a contiguous copy.
Tensor swap_grid(const Tensor& t) { return t.transpose(-3, -2).contiguous(); }

}  // namespace

TEST(Axial, EqualsTwoPassesOfAttention) {
  for (DType dtype : {DType::float64, DType::float32}) {
    SCOPED_TRACE(to_string(dtype));
    Tensor q = random_tensor({2, 3, 5, 7, 4}, 1, dtype), k = random_tensor({2, 3, 5, 7, 4}, 2, dtype),
           v = random_tensor({2, 3, 5, 7, 6}, 3, dtype);
    AxialOutput f = axial_attention_forward(q, k, v, {.scale = 0.7});
    const AttentionOptions o{.scale = 0.7, .path = AttentionPath::reference};
    const Tensor y = attention_forward(q.to(DType::float64), k.to(DType::float64), v.to(DType::float64), o).out;  // along rows
    const Tensor expected =
        swap_grid(attention_forward(swap_grid(q.to(DType::float64)), swap_grid(k.to(DType::float64)), swap_grid(y), o).out);
    EXPECT_LT(max_abs_diff(f.out, expected), dtype == DType::float64 ? 1e-13 : 2e-5);
    EXPECT_EQ(f.row.lse.shape(), (Shape{2, 3, 5, 7}));
    EXPECT_EQ(f.column.lse.shape(), (Shape{2, 3, 7, 5}));
    if (dtype == DType::float32) {
      EXPECT_EQ(f.row.path, AttentionPath::fused);
    }
  }
}

TEST(Axial, FiniteDifferenceGradients) {
  Tensor q = random_tensor({2, 3, 5, 3}, 11), k = random_tensor({2, 3, 5, 3}, 12), v = random_tensor({2, 3, 5, 2}, 13);
  AxialOutput f = axial_attention_forward(q, k, v);
  Tensor r = random_tensor(f.out.shape(), 14);
  AttentionGradients g = axial_attention_backward(r, q, k, v, f);
  expect_gradients("axial 3 x 5 E=3 Ev=2", r, [&] { return axial_attention_forward(q, k, v).out; },
                   {{"dq", q, g.dquery}, {"dk", k, g.dkey}, {"dv", v, g.dvalue}});
  // float32 on the fused path agrees with float64.
  Tensor q32 = q.to(DType::float32), k32 = k.to(DType::float32), v32 = v.to(DType::float32);
  AttentionGradients g32 = axial_attention_backward(r.to(DType::float32), q32, k32, v32, axial_attention_forward(q32, k32, v32));
  EXPECT_LT(max_abs_diff(g32.dquery, g.dquery), 1e-4);
  EXPECT_LT(max_abs_diff(g32.dvalue, g.dvalue), 1e-4);
}

TEST(Axial, OnePixel) {
  Tensor q = random_tensor({1, 1, 3}, 1), k = random_tensor({1, 1, 3}, 2), v = random_tensor({1, 1, 2}, 3);
  AxialOutput f = axial_attention_forward(q, k, v);
  EXPECT_LT(max_abs_diff(f.out, v), 1e-15);
  AttentionGradients g = axial_attention_backward(v, q, k, v, f);
  EXPECT_LT(max_abs_diff(g.dvalue, v), 1e-15);
  EXPECT_EQ(max_abs(g.dquery), 0.0);
}

TEST(Axial, Errors) {
  Tensor q = random_tensor({2, 3, 5, 4}, 1), v = random_tensor({2, 3, 5, 2}, 2);
  const std::string fn = "[mha::axial_attention_forward] ";
  expect_error<ShapeError>([&] { axial_attention_forward(random_tensor({5, 4}, 1), random_tensor({5, 4}, 1), random_tensor({5, 4}, 1)); },
                 fn + "query: expected at least 3 dims (…, rows, cols, E); got (5, 4)");
  expect_error<ShapeError>([&] { axial_attention_forward(q, random_tensor({2, 3, 6, 4}, 1), v); },
                 fn + "key: expected query's shape (2, 3, 5, 4); got (2, 3, 6, 4)");
  expect_error<ShapeError>([&] { axial_attention_forward(q, q, random_tensor({2, 5, 3, 2}, 1)); },
                 fn + "value: expected the leading dims (2, 3, 5) of query (2, 3, 5, 4); got (2, 5, 3, 2)");
  expect_error<ValueError>([&] { axial_attention_forward(q, q, v, {.path = AttentionPath::fused}); },
                 fn + "options.path: expected float32 inputs for the fused path; got float64 inputs");
  AxialOutput f = axial_attention_forward(q, q, v);
  AxialOutput wrong = f;
  wrong.column.lse = f.row.lse;
  expect_error<ShapeError>([&] { axial_attention_backward(v, q, q, v, wrong); },
                 "[mha::axial_attention_backward] forward.column.lse: expected shape (2, 5, 3); got (2, 3, 5)");
}
