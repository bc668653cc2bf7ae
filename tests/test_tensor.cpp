// Tensor: views, copies, dtypes, alignment and the random generator.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <vector>

#include <unistd.h>

#include "cpu/allocator.h"
#include "mha/mha.h"

using namespace mha;

TEST(Tensor, FactoriesAndShape) {
  Tensor t = Tensor::zeros({2, 3, 4});
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.item({1, 2, 3}), 0.0);
  Tensor f = Tensor::full({2}, 2.5, DType::float64);
  EXPECT_EQ(f.to_vector(), (std::vector<double>{2.5, 2.5}));
}

TEST(Tensor, AllocationIs64ByteAligned) {
  for (int64_t n : {1, 3, 17, 1000}) {
    Tensor t = Tensor::empty({n}, DType::bfloat16);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 64, 0u);
  }
}

// Blocks with huge pages start on a 2 MiB boundary (cpu/allocator.h); not
// under AddressSanitizer, which owns malloc.
TEST(Tensor, LargeAllocationsStartOnHugePageBoundaries) {
#if !defined(MHA_ADDRESS_SANITIZER)
  for (int64_t floats : {(int64_t(3) << 20) / 4, int64_t(1) << 20, (int64_t(5) << 20) / 4 + 3, int64_t(9) << 20,
                         int64_t(300) << 10, int64_t(2) * 4 * 2040 * 64}) {
    Tensor t = Tensor::empty({floats}, DType::float32);
    const bool huge = cpu::huge_page_extent(size_t(floats) * 4) > 0;
    if (huge) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % (uintptr_t(2) << 20), 0u) << floats;
    }
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 64, 0u) << floats;
    t.fill_(1.5);
    EXPECT_EQ(t.item({floats - 1}), 1.5);
  }
#endif
}

// The whole 2 MiB pages of a request, and the last one where the request
// fills 15/16 of it: long's (2, 4, 2040, 64) floats, 16 KiB short of 4 MiB,
// take two; mid's (16 · 131, 256), 48 KiB over 2 MiB, one.
TEST(Tensor, HugePageExtentRoundsUpOnlyANearlyFullPage) {
  constexpr size_t MiB = size_t(1) << 20;
  EXPECT_EQ(cpu::huge_page_extent(0), 0u);
  EXPECT_EQ(cpu::huge_page_extent(MiB), 0u);
  EXPECT_EQ(cpu::huge_page_extent(2 * MiB - MiB / 8 - 1), 0u);
  EXPECT_EQ(cpu::huge_page_extent(2 * MiB - MiB / 8), 2 * MiB);
  EXPECT_EQ(cpu::huge_page_extent(2 * MiB), 2 * MiB);
  EXPECT_EQ(cpu::huge_page_extent(size_t(16) * 131 * 256 * 4), 2 * MiB);
  EXPECT_EQ(cpu::huge_page_extent(3 * MiB), 2 * MiB);
  EXPECT_EQ(cpu::huge_page_extent(size_t(2) * 4 * 2040 * 64 * 4), 4 * MiB);
  EXPECT_EQ(cpu::huge_page_extent(4 * MiB + 1), 4 * MiB);
  for (size_t used = 1; used < 64 * MiB; used = used * 3 / 2 + 7) {
    const size_t extent = cpu::huge_page_extent(used);
    EXPECT_EQ(extent % (2 * MiB), 0u) << used;
    EXPECT_LE(extent, used + MiB / 8) << used;   // at most 128 KiB past the request
    EXPECT_GT(extent + 2 * MiB, used) << used;  // every whole page inside it
  }
}

TEST(Tensor, MemoryCountersFollowStorage) {
  const int64_t before = active_memory();
  reset_peak_memory();
  EXPECT_EQ(peak_memory(), before);
  {
    Tensor a = Tensor::empty({1000});                 // 4000 bytes
    Tensor view = a.slice(0, 10, 20).transpose(0, 0);  // no new storage
    Tensor b = Tensor::zeros({3, 5}, DType::bfloat16);
    EXPECT_EQ(active_memory() - before, 4000 + 30);
    float x[4];
    Tensor borrowed = Tensor::from_blob(x, {4}, {1}, DType::float32, nullptr);  // not counted
    EXPECT_EQ(active_memory() - before, 4030);
  }
  EXPECT_EQ(active_memory(), before);
  EXPECT_EQ(peak_memory() - before, 4030);
  reset_peak_memory();
  EXPECT_EQ(peak_memory(), before);
}

TEST(Tensor, FromBlobViewsForeignMemoryAndKeepsItsOwnerAlive) {
  auto owner = std::make_shared<std::vector<float>>(std::vector<float>{0, 1, 2, 3, 4, 5});
  std::weak_ptr<std::vector<float>> watch = owner;
  // A transposed (2, 3) buffer: shape (3, 2), strides (1, 3).
  Tensor t = Tensor::from_blob(owner->data(), {3, 2}, {1, 3}, DType::float32, owner);
  owner.reset();
  EXPECT_FALSE(watch.expired());
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.to_vector(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  t.set_item({2, 1}, 9);  // writes through to the foreign buffer
  EXPECT_EQ(watch.lock()->at(5), 9.0f);
  Tensor view = t.slice(0, 1, 3);
  t = Tensor();
  EXPECT_FALSE(watch.expired());  // the view still holds the owner
  view = Tensor();
  EXPECT_TRUE(watch.expired());
  float x = 1;
  EXPECT_THROW(Tensor::from_blob(&x, {2}, {-1}, DType::float32, nullptr), ShapeError);
  EXPECT_THROW(Tensor::from_blob(&x, {2, 2}, {1}, DType::float32, nullptr), ShapeError);
  EXPECT_THROW(Tensor::from_blob(nullptr, {2}, {1}, DType::float32, nullptr), ValueError);
  EXPECT_EQ(Tensor::from_blob(nullptr, {0, 3}, {3, 1}, DType::float32, nullptr).numel(), 0);
}

// Copies and fills large enough to run on every thread (tensor.cpp,
// strided.h: rows split over threads, each thread's first index decomposed):
// every element lands where a serial walk puts it, through views that
// permute, slice and change dtype, with the row lengths as they come.
TEST(Tensor, LargeCopiesAndFillsThroughViews) {
  const Shape shape{3, 50, 7, 41};
  std::vector<double> values(size_t(shape_numel(shape)));
  for (size_t i = 0; i < values.size(); ++i) values[i] = double(i);
  const Tensor src = Tensor::from_values(values, shape);
  for (const auto& [perm, dtype] : {std::pair{std::vector<int64_t>{0, 1, 2, 3}, DType::float32},
                                    {{2, 0, 3, 1}, DType::float32}, {{1, 3, 0, 2}, DType::float64}, {{3, 2, 1, 0}, DType::bfloat16}}) {
    const Tensor view = src.permute(perm);
    Tensor dst = Tensor::empty(view.shape(), dtype);
    dst.copy_(view);
    const Shape& s = view.shape();
    for (int64_t a = 0; a < s[0]; ++a)
      for (int64_t b = 0; b < s[1]; b += 3)
        for (int64_t c = 0; c < s[2]; ++c)
          for (int64_t d = 0; d < s[3]; d += 2) {
            const double want = view.item({a, b, c, d});
            ASSERT_EQ(dst.item({a, b, c, d}), dtype == DType::bfloat16 ? double(float(bfloat16(float(want)))) : want);
          }
  }
  Tensor big = Tensor::zeros({3, 50, 7, 41});
  big.slice(1, 10, 40).transpose(0, 3).fill_(2.5);
  const std::vector<double> filled = big.to_vector();
  for (int64_t i = 0; i < int64_t(filled.size()); ++i) {
    const int64_t j = i / (7 * 41) % 50;
    ASSERT_EQ(filled[size_t(i)], j >= 10 && j < 40 ? 2.5 : 0.0) << i;
  }
}

TEST(Tensor, TransposeSliceSelectViewsShareStorage) {
  std::vector<double> v(12);
  for (int i = 0; i < 12; ++i) v[size_t(i)] = i;
  Tensor t = Tensor::from_values(v, {3, 4}, DType::float64);
  Tensor tt = t.transpose(0, 1);
  EXPECT_EQ(tt.shape(), (Shape{4, 3}));
  EXPECT_FALSE(tt.is_contiguous());
  EXPECT_EQ(tt.item({3, 2}), 11.0);
  Tensor s = t.slice(1, 1, 4, 2);  // columns 1, 3
  EXPECT_EQ(s.shape(), (Shape{3, 2}));
  EXPECT_EQ(s.to_vector(), (std::vector<double>{1, 3, 5, 7, 9, 11}));
  Tensor row = t.select(0, -1);
  EXPECT_EQ(row.to_vector(), (std::vector<double>{8, 9, 10, 11}));
  row.set_item({0}, 100.0);
  EXPECT_EQ(t.item({2, 0}), 100.0);  // a view writes through
  Tensor c = tt.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.to_vector(), tt.to_vector());
  c.set_item({0, 0}, -1.0);
  EXPECT_EQ(t.item({0, 0}), 0.0);  // contiguous() of a non-contiguous view copies
}

TEST(Tensor, ReshapeViewPermuteExpand) {
  Tensor t = Tensor::from_values(std::vector<double>{0, 1, 2, 3, 4, 5}, {2, 3}, DType::float32);
  EXPECT_EQ(t.view({3, -1}).shape(), (Shape{3, 2}));
  EXPECT_THROW(t.transpose(0, 1).view({6}), ShapeError);
  EXPECT_EQ(t.transpose(0, 1).reshape({6}).to_vector(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  Tensor p = t.unsqueeze(0).permute({2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{3, 1, 2}));
  EXPECT_EQ(p.item({2, 0, 1}), 5.0);
  Tensor e = Tensor::from_values(std::vector<double>{1, 2}, {2, 1}, DType::float32).expand({3, 2, 4});
  EXPECT_EQ(e.shape(), (Shape{3, 2, 4}));
  EXPECT_EQ(e.stride(0), 0);
  EXPECT_EQ(e.item({2, 1, 3}), 2.0);
  EXPECT_THROW(t.squeeze(0), ShapeError);
  EXPECT_EQ(t.unsqueeze(1).squeeze(1).shape(), t.shape());
}

TEST(Tensor, DtypeConversionAndBfloat16Rounding) {
  Tensor t = Tensor::from_values(std::vector<double>{1.0, 1.00390625, 1.01171875, -3.5e38, 0.1}, {5},
                                 DType::float32);
  Tensor b = t.to(DType::bfloat16);
  std::vector<double> v = b.to_vector();
  EXPECT_EQ(v[0], 1.0);
  EXPECT_EQ(v[1], 1.0);         // halfway between 1 and 1+2^-7: ties to even
  EXPECT_EQ(v[2], 1.015625);    // halfway between 1+2^-7 and 1+2^-6: ties to even (up)
  EXPECT_TRUE(std::isinf(v[3]));
  EXPECT_NEAR(v[4], 0.1, 0.001);
  EXPECT_EQ(bfloat16(NAN).bits & 0x7f80, 0x7f80);
  EXPECT_TRUE(std::isnan(float(bfloat16(NAN))));
  Tensor back = b.to(DType::float64);
  EXPECT_EQ(back.dtype(), DType::float64);
  EXPECT_EQ(back.item({0}), 1.0);
  Tensor m = Tensor::from_bools({true, false}, {2});
  EXPECT_EQ(m.dtype(), DType::boolean);
  EXPECT_EQ(m.to(DType::float32).to_vector(), (std::vector<double>{1.0, 0.0}));
}

TEST(Tensor, DataChecksTheElementType) {
  Tensor t = Tensor::zeros({2});
  EXPECT_NO_THROW(t.data<float>());
  EXPECT_THROW(t.data<double>(), DtypeError);
  EXPECT_THROW(Tensor().data<float>(), ShapeError);
}

TEST(Tensor, CudaDeviceThrowsNotBuiltWithCuda) {
  try {
    Tensor::empty({2}, DType::float32, Device::cuda);
    FAIL() << "expected DeviceError";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("not built with CUDA"), std::string::npos) << e.what();
  }
}

TEST(Random, StreamsDoNotDependOnThreadCount) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  Generator g1(42);
  std::vector<double> one = randn({10000}, g1).to_vector();  // past the size that fills on several threads
  omp_set_num_threads(2);
  Generator g2(42);
  std::vector<double> two = randn({10000}, g2).to_vector();
  omp_set_num_threads(saved);
  EXPECT_EQ(one, two);
  EXPECT_EQ(g1.offset(), g2.offset());
}

TEST(Random, NextUniformIsTheValueOfAOneElementTensor) {
  Generator a(7), b(7);
  for (int i = 0; i < 100; ++i) {
    const double u = a.next_uniform();
    EXPECT_EQ(u, rand_uniform({1}, b, 0.0, 1.0, DType::float64).item({0}));
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
    EXPECT_EQ(a.offset(), b.offset());
  }
}

TEST(Random, MomentsAndDistinctStreams) {
  Generator g(7);
  std::vector<double> n = randn({20000}, g, 0.0, 1.0, DType::float64).to_vector();
  double mean = 0, var = 0;
  for (double x : n) mean += x;
  mean /= double(n.size());
  for (double x : n) var += (x - mean) * (x - mean);
  var /= double(n.size());
  EXPECT_NEAR(mean, 0.0, 0.03);
  EXPECT_NEAR(var, 1.0, 0.05);
  std::vector<double> u = rand_uniform({20000}, g, -2.0, 2.0, DType::float64).to_vector();
  for (double x : u) ASSERT_TRUE(x >= -2.0 && x < 2.0);
  std::vector<double> next = randn({20000}, g, 0.0, 1.0, DType::float64).to_vector();
  EXPECT_NE(n, next);  // the generator advanced
  Generator same(7);
  EXPECT_EQ(randn({20000}, same, 0.0, 1.0, DType::float64).to_vector(), n);
}

// The idle cache holds up to the most bytes ever in use at once, evicting the
// least recently freed: three blocks of 112 MiB freed after three of 96 MiB
// (more than 256 MiB each time) all come back, with what was written in them.
TEST(Tensor, IdleBlocksPastTheCapEvictTheOldestFirst) {
#if defined(MHA_ADDRESS_SANITIZER)
  GTEST_SKIP() << "the block cache is off under AddressSanitizer, so that use-after-free is caught";
#else
  auto round = [](size_t mib, unsigned char mark) {
    std::vector<void*> blocks;
    for (int i = 0; i < 3; ++i) {
      blocks.push_back(cpu::host_allocate(mib << 20));
      static_cast<unsigned char*>(blocks.back())[0] = mark;
    }
    return blocks;
  };
  for (void* p : round(96, 1)) cpu::host_free(p);
  std::vector<void*> first = round(112, 2);
  for (void* p : first) cpu::host_free(p);
  std::vector<void*> again;
  for (int i = 0; i < 3; ++i) again.push_back(cpu::host_allocate(112 << 20));
  for (void* p : again) {
    EXPECT_NE(std::find(first.begin(), first.end(), p), first.end()) << "a fresh block, not a cached one";
    EXPECT_EQ(static_cast<unsigned char*>(p)[0], 2) << "fresh pages, not the cached block's";
    cpu::host_free(p);
  }
#endif
}

// A miss frees idle blocks first where keeping them would hold more than a
// quarter over the most ever in use: 480 MiB idle (three blocks of 160, more
// than any earlier test holds at once, so the peak is theirs), then a 448 MiB
// block of another size. Kept, the process would hold 928 MiB, 448 more than
// before; past 1.25 · 480 = 600 all three go, and it holds 32 less. Resident
// pages from /proc (every block written whole).
TEST(Tensor, AFreshBlockFreesIdleBlocksPastAQuarterOverThePeak) {
#if defined(MHA_ADDRESS_SANITIZER)
  GTEST_SKIP() << "the block cache is off under AddressSanitizer, so that use-after-free is caught";
#else
  const auto resident_mib = [] {
    std::ifstream statm("/proc/self/statm");
    size_t pages = 0, resident = 0;
    statm >> pages >> resident;
    return double(resident) * double(sysconf(_SC_PAGESIZE)) / double(1 << 20);
  };
  std::vector<void*> blocks;
  for (int i = 0; i < 3; ++i) {
    blocks.push_back(cpu::host_allocate(size_t(160) << 20));
    std::memset(blocks.back(), 1, size_t(160) << 20);
  }
  for (void* p : blocks) cpu::host_free(p);
  const double before = resident_mib();
  void* fresh = cpu::host_allocate(size_t(448) << 20);
  std::memset(fresh, 2, size_t(448) << 20);
  const double grew = resident_mib() - before;
  EXPECT_LT(grew, 224.0) << "idle blocks kept beside the fresh one";
  cpu::host_free(fresh);
#endif
}

TEST(Tensor, LargeBlocksAreReusedAfterFree) {
#if defined(MHA_ADDRESS_SANITIZER)
  GTEST_SKIP() << "the block cache is off under AddressSanitizer, so that use-after-free is caught";
#else
  const void* first = nullptr;
  {
    Tensor t = Tensor::empty({1 << 20});  // 4 MiB
    first = t.raw_data();
  }
  Tensor again = Tensor::empty({1 << 20});
  EXPECT_EQ(again.raw_data(), first);  // no fresh pages for the same size
  EXPECT_EQ(reinterpret_cast<uintptr_t>(again.raw_data()) % 64, 0u);
  Tensor small = Tensor::empty({3});
  EXPECT_NE(small.raw_data(), nullptr);
#endif
}
