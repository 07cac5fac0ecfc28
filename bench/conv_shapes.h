// The distinct conv shapes of CIFAR ResNet-20, ResNet-18, VGG16-BN and MobileNetV2, with how often each
// occurs: the conv micro-benchmarks' workload (bench_conv on the CPU, bench_cuda_conv on a GPU).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace et::bench {

struct Shape2 {
  std::string net, name;
  int64_t C, K, H, W, R, stride, groups, count;
};

// Distinct conv shapes per network with their multiplicity (padding = R/2 everywhere).
inline std::vector<Shape2> all_shapes() {
  std::vector<Shape2> v;
  auto add = [&](const std::string& net, int64_t C, int64_t K, int64_t H, int64_t R, int64_t s, int64_t gr) {
    for (auto& e : v)
      if (e.net == net && e.C == C && e.K == K && e.H == H && e.R == R && e.stride == s && e.groups == gr) {
        ++e.count;
        return;
      }
    char buf[96];
    std::snprintf(buf, sizeof buf, "%s%ldx%ld_%ldto%ld_h%ld%s", gr > 1 ? "dw" : "c", long(R), long(R), long(C),
                  long(K), long(H), s > 1 ? "_s2" : "");
    v.push_back({net, buf, C, K, H, H, R, s, gr, 1});
  };
  // ResNet-20: stem, 3 stages of 3 basic blocks, 1x1 s2 shortcuts.
  add("resnet20", 3, 16, 32, 3, 1, 1);
  const int64_t wd[3] = {16, 32, 64};
  int64_t in = 16, h = 32;
  for (int st = 0; st < 3; ++st)
    for (int b = 0; b < 3; ++b) {
      const int64_t s = (st > 0 && b == 0) ? 2 : 1;
      add("resnet20", in, wd[st], h, 3, s, 1);
      const int64_t ho = h / s;
      add("resnet20", wd[st], wd[st], ho, 3, 1, 1);
      if (s != 1 || in != wd[st]) add("resnet20", in, wd[st], h, 1, s, 1);
      in = wd[st];
      h = ho;
    }
  // ResNet-18 (CIFAR): a 3x3 stem, 4 stages of 2 basic blocks (64 to 512 channels), 1x1 s2 shortcuts.
  add("resnet18", 3, 64, 32, 3, 1, 1);
  in = 64, h = 32;
  for (int st = 0; st < 4; ++st)
    for (int b = 0; b < 2; ++b) {
      const int64_t out = int64_t(64) << st, s = (st > 0 && b == 0) ? 2 : 1;
      add("resnet18", in, out, h, 3, s, 1);
      const int64_t ho = h / s;
      add("resnet18", out, out, ho, 3, 1, 1);
      if (s != 1 || in != out) add("resnet18", in, out, h, 1, s, 1);
      in = out;
      h = ho;
    }
  // VGG16-BN: 3x3 convs, max-pool halves the map.
  const int cfg[] = {64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0};
  in = 3;
  h = 32;
  for (int c : cfg) {
    if (c == 0) {
      h /= 2;
      continue;
    }
    add("vgg16", in, c, h, 3, 1, 1);
    in = c;
  }
  // MobileNetV2-CIFAR (see models/mobilenetv2.cpp).
  struct St { int64_t e, out, n, s; };
  const St sts[] = {{1, 16, 1, 1}, {6, 24, 2, 1}, {6, 32, 3, 2}, {6, 64, 4, 2}, {6, 96, 3, 1}, {6, 160, 3, 2}, {6, 320, 1, 1}};
  add("mobilenetv2", 3, 32, 32, 3, 1, 1);
  in = 32;
  h = 32;
  for (const St& st : sts)
    for (int64_t b = 0; b < st.n; ++b) {
      const int64_t s = b == 0 ? st.s : 1, hid = in * st.e;
      add("mobilenetv2", in, hid, h, 1, 1, 1);
      add("mobilenetv2", hid, hid, h, 3, s, hid);
      const int64_t ho = (h + 2 - 3) / s + 1;
      add("mobilenetv2", hid, st.out, ho, 1, 1, 1);
      if (s == 1 && in != st.out) add("mobilenetv2", in, st.out, h, 1, 1, 1);
      in = st.out;
      h = ho;
    }
  add("mobilenetv2", 320, 1280, h, 1, 1, 1);
  return v;
}

}  // namespace et::bench
