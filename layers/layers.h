// Op builders: each checks shapes, creates the layer's parameters (named "<layer>.weight", ...,
// as PyTorch names them) and wires one node. Shape errors are user errors naming the layer.
// All activations are NCHW; [N, F] after flatten / global pooling.
#pragma once
#include <string>

#include "engine/executor.h"
#include "engine/graph.h"

namespace et {

struct Conv2dOptions {
  int64_t out_channels = 0;
  int64_t kernel = 3, stride = 1, padding = 0, groups = 1;
  bool bias = false;
};

// Inputs of the graph: images [N,C,H,W] (f32) and labels [N] (i32).
int image_input(Graph& g, int64_t batch, int64_t channels, int64_t height, int64_t width);
int label_input(Graph& g, int64_t batch);

int conv2d(Graph& g, int x, const std::string& name, const Conv2dOptions& o);
int linear(Graph& g, int x, const std::string& name, int64_t out_features, bool bias = true);
int batchnorm2d(Graph& g, int x, const std::string& name, float momentum = 0.1f, float eps = 1e-5f);
int relu(Graph& g, int x, const std::string& name);
int dropout(Graph& g, int x, const std::string& name, float p);
int maxpool2d(Graph& g, int x, const std::string& name, int64_t kernel, int64_t stride, int64_t padding = 0);
int avgpool2d(Graph& g, int x, const std::string& name, int64_t kernel, int64_t stride, int64_t padding = 0);
int global_avgpool(Graph& g, int x, const std::string& name);
// Option-A shortcut: x[:, :, ::stride, ::stride] with zero channels to out_channels, (K - C) / 2 of
// them before x's (as the CIFAR ResNets' F.pad(x[:, :, ::2, ::2], (0,0,0,0,K/4,K/4)) does for K = 2C).
int subsample_pad(Graph& g, int x, const std::string& name, int64_t out_channels, int64_t stride);
int add(Graph& g, int a, int b, const std::string& name);
int flatten(Graph& g, int x, const std::string& name);
// Mean softmax cross-entropy over the batch; target = (1 - s) one-hot + s / K.
int softmax_cross_entropy(Graph& g, int logits, int labels, const std::string& name, float label_smoothing = 0.f);

// Helper for builders: a new batched activation value named `name` of shape `s`.
Value activation(const std::string& name, const Shape& s);
// A new parameter value.
int add_param(Graph& g, const std::string& name, const Shape& s, ParamInit init, int64_t fan);

}  // namespace et
