// Minimal C++ embedding of a dspark bundle's TensorRT engines: loads the plugin library and the three engines,
// prefills a prompt given as token ids, then runs greedy DSpark rounds (draft -> heads -> verify) and prints the
// committed tokens. Batch 1, no streaming optimisations: the point is the contract between the engines.
//
//   ./dspark_round BUNDLE NUM_LAYERS KV_HEADS HEAD_DIM DRAFT_LAYERS DRAFT_KV_HEADS BLOCK VOCAB TAP_WIDTH CAPACITY ROUNDS id...
// (the numbers are in BUNDLE/manifest.json: target/draft dims, block_size, vocab, taps = len(ids) * hidden)
#include <NvInfer.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace {

class Logger : public ILogger {
  void log(Severity severity, AsciiChar const* msg) noexcept override {
    if (severity <= Severity::kWARNING) std::cerr << "[trt] " << msg << "\n";
  }
} gLogger;

#define CHECK_CUDA(x)                                                              \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      std::cerr << "CUDA error " << cudaGetErrorString(e) << " at " << #x << "\n"; \
      std::exit(2);                                                                \
    }                                                                              \
  } while (0)

// A host tensor: raw bytes plus shape; element size comes from the engine's tensor type.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  template <typename T>
  static Tensor of(std::vector<int64_t> shape, std::vector<T> const& values) {
    Tensor t;
    t.shape = std::move(shape);
    t.bytes.resize(values.size() * sizeof(T));
    std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
    return t;
  }
  template <typename T>
  T const* as() const { return reinterpret_cast<T const*>(bytes.data()); }
};

size_t elementSize(DataType t) {
  switch (t) {
    case DataType::kINT64: return 8;
    case DataType::kFLOAT: case DataType::kINT32: return 4;
    case DataType::kHALF: case DataType::kBF16: return 2;
    default: return 1;
  }
}

class Engine {
 public:
  Engine(IRuntime& runtime, std::string const& path, int verifyPositions = 0) : verifyPositions_(verifyPositions) {
    std::ifstream f(path, std::ios::binary);
    std::vector<char> blob((std::istreambuf_iterator<char>(f)), {});
    engine_.reset(runtime.deserializeCudaEngine(blob.data(), blob.size()));
    if (!engine_) { std::cerr << "cannot load " << path << "\n"; std::exit(2); }
    context_.reset(engine_->createExecutionContext());
    CHECK_CUDA(cudaStreamCreate(&stream_));
  }
  ~Engine() {
    for (auto& kv : device_) cudaFree(kv.second.first);
    cudaStreamDestroy(stream_);
  }

  std::map<std::string, Tensor> run(std::map<std::string, Tensor> const& inputs) {
    int profile = 0;
    if (engine_->getNbOptimizationProfiles() > 1 && inputs.count("tokens"))
      profile = inputs.at("tokens").shape[1] <= verifyPositions_ ? 1 : 0;
    context_->setOptimizationProfileAsync(profile, stream_);
    std::map<std::string, Tensor> outputs;
    for (int i = 0; i < engine_->getNbIOTensors(); ++i) {
      char const* name = engine_->getIOTensorName(i);
      if (engine_->getTensorIOMode(name) != TensorIOMode::kINPUT) continue;
      Tensor const& t = inputs.at(name);
      Dims d{};
      d.nbDims = static_cast<int32_t>(t.shape.size());
      for (int k = 0; k < d.nbDims; ++k) d.d[k] = t.shape[k];
      context_->setInputShape(name, d);
      void* ptr = buffer(name, t.bytes.size());
      CHECK_CUDA(cudaMemcpyAsync(ptr, t.bytes.data(), t.bytes.size(), cudaMemcpyHostToDevice, stream_));
      context_->setTensorAddress(name, ptr);
    }
    for (int i = 0; i < engine_->getNbIOTensors(); ++i) {
      char const* name = engine_->getIOTensorName(i);
      if (engine_->getTensorIOMode(name) != TensorIOMode::kOUTPUT) continue;
      Dims d = context_->getTensorShape(name);
      Tensor t;
      size_t n = 1;
      for (int k = 0; k < d.nbDims; ++k) { t.shape.push_back(d.d[k]); n *= static_cast<size_t>(d.d[k]); }
      t.bytes.resize(n * elementSize(engine_->getTensorDataType(name)));
      context_->setTensorAddress(name, buffer(name, t.bytes.size()));
      outputs[name] = std::move(t);
    }
    if (!context_->enqueueV3(stream_)) { std::cerr << "enqueue failed\n"; std::exit(2); }
    for (auto& kv : outputs)
      CHECK_CUDA(cudaMemcpyAsync(kv.second.bytes.data(), device_[kv.first].first, kv.second.bytes.size(),
                                 cudaMemcpyDeviceToHost, stream_));
    CHECK_CUDA(cudaStreamSynchronize(stream_));
    return outputs;
  }

 private:
  void* buffer(std::string const& name, size_t bytes) {
    auto& slot = device_[name];
    if (bytes > slot.second) {
      if (slot.first) CHECK_CUDA(cudaFree(slot.first));
      CHECK_CUDA(cudaMalloc(&slot.first, bytes ? bytes : 1));
      slot.second = bytes;
    }
    return slot.first;
  }
  std::unique_ptr<ICudaEngine> engine_;
  std::unique_ptr<IExecutionContext> context_;
  cudaStream_t stream_{};
  std::map<std::string, std::pair<void*, size_t>> device_;
  int verifyPositions_;
};

// Host KV cache [L][2][1][Hkv][capacity][hd] with a valid length; graphs get one tensor per layer and kind.
struct Cache {
  int layers, heads, capacity, headDim, length = 0;
  std::vector<std::vector<float>> kv;  // 2 * layers tensors of heads * capacity * headDim
  Cache(int l, int h, int c, int d) : layers(l), heads(h), capacity(c), headDim(d),
      kv(2 * l, std::vector<float>(static_cast<size_t>(h) * c * d, 0.f)) {}
  void feed(std::map<std::string, Tensor>& in, std::string const& prefix) const {
    for (int l = 0; l < layers; ++l)
      for (int k = 0; k < 2; ++k)
        in[prefix + "." + std::to_string(l) + (k ? ".value" : ".key")] =
            Tensor::of<float>({1, heads, capacity, headDim}, kv[2 * l + k]);
    std::vector<int64_t> mask(capacity, 0);
    for (int i = 0; i < length; ++i) mask[i] = 1;
    in["past_mask"] = Tensor::of<int64_t>({1, capacity}, mask);
  }
  // new K/V [L][2][1][Hkv][T][hd]: append the first `count` positions after the valid prefix.
  void append(Tensor const& fresh, int count) {
    int steps = static_cast<int>(fresh.shape[4]);
    float const* src = fresh.as<float>();
    for (int l = 0; l < layers; ++l)
      for (int k = 0; k < 2; ++k)
        for (int h = 0; h < heads; ++h)
          for (int t = 0; t < count; ++t)
            std::memcpy(&kv[2 * l + k][(static_cast<size_t>(h) * capacity + length + t) * headDim],
                        &src[((((static_cast<size_t>(l) * 2 + k) * heads + h) * steps) + t) * headDim],
                        headDim * sizeof(float));
    length += count;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 14) {
    std::cerr << "usage: dspark_round BUNDLE L HKV HD DRAFT_L DRAFT_HKV BLOCK VOCAB TAP_WIDTH CAPACITY ROUNDS id...\n"
                 "  CAPACITY: the engines' cache size, tensorrt.max_context in BUNDLE/manifest.json\n";
    return 2;
  }
  std::string bundle = argv[1];
  int L = std::atoi(argv[2]), hkv = std::atoi(argv[3]), hd = std::atoi(argv[4]);
  int dl = std::atoi(argv[5]), dhkv = std::atoi(argv[6]), block = std::atoi(argv[7]);
  int vocab = std::atoi(argv[8]), tapWidth = std::atoi(argv[9]);
  int capacity = std::atoi(argv[10]), rounds = std::atoi(argv[11]);
  std::vector<int64_t> prompt;
  for (int i = 12; i < argc; ++i) prompt.push_back(std::atoll(argv[i]));
  int n = static_cast<int>(prompt.size());
  // The engines' profiles fix the cache size (every step binds caches of exactly this capacity).
  if (n + rounds * (block + 1) + block + 2 > capacity) {
    std::cerr << "prompt + rounds do not fit the engines' cache of " << capacity << " positions\n";
    return 2;
  }

  std::unique_ptr<IRuntime> runtime{createInferRuntime(gLogger)};
  if (!runtime->getPluginRegistry().loadLibrary((bundle + "/engines/libdspark_trt_plugin.so").c_str())) {
    std::cerr << "cannot load the dspark plugin library\n";
    return 2;
  }
  Engine verifier(*runtime, bundle + "/engines/verifier.plan", block + 1);
  Engine draft(*runtime, bundle + "/engines/draft.plan");
  Engine heads(*runtime, bundle + "/engines/heads.plan");
  Cache target(L, hkv, capacity, hd), drafter(dl, dhkv, capacity, hd);

  auto verify = [&](std::vector<int64_t> const& tokens, int64_t logitRow, int64_t verifyLen,
                    Tensor const* draftProbs) {
    std::map<std::string, Tensor> in;
    target.feed(in, "past");
    int t = static_cast<int>(tokens.size());
    int rows = verifyLen > 0 ? t : 1;
    std::vector<int64_t> logitIndex(rows);
    for (int i = 0; i < rows; ++i) logitIndex[i] = verifyLen > 0 ? i : logitRow;
    in["tokens"] = Tensor::of<int64_t>({1, t}, tokens);
    in["logit_index"] = Tensor::of<int64_t>({1, rows}, logitIndex);
    in["verify_len"] = Tensor::of<int64_t>({1}, {verifyLen});
    in["temperature"] = Tensor::of<float>({1}, {0.f});  // greedy: noise values do not matter
    in["accept_noise"] = Tensor::of<float>({1, rows}, std::vector<float>(rows, 1.f));
    in["sample_noise"] = Tensor::of<float>({1}, {1.f});
    in["draft_probs"] = draftProbs ? *draftProbs
                                   : Tensor::of<float>({1, 1, vocab}, std::vector<float>(vocab, 0.f));
    return verifier.run(in);
  };

  auto out = verify(prompt, n - 1, 0, nullptr);
  target.append(out["new_kv"], n);
  int64_t anchor = out["next_token"].as<int64_t>()[0];
  Tensor ctx = out["taps"];
  int64_t ctxCount = n;
  std::vector<int64_t> committed{anchor};
  std::vector<float> sps(8, 1.f);
  for (int r = 0; r < rounds; ++r) {
    std::map<std::string, Tensor> din;
    drafter.feed(din, "draft_past");
    din["ctx_features"] = ctx;
    din["ctx_count"] = Tensor::of<int64_t>({1}, {ctxCount});
    din["anchor"] = Tensor::of<int64_t>({1}, {anchor});
    auto d = draft.run(din);
    drafter.append(d["new_draft_kv"], static_cast<int>(ctxCount));
    std::map<std::string, Tensor> hin{{"hidden", d["hidden"]}};
    hin["anchor"] = Tensor::of<int64_t>({1}, {anchor});
    hin["temperature"] = Tensor::of<float>({1}, {0.f});
    hin["draft_noise"] = Tensor::of<float>({1, block}, std::vector<float>(block, 1.f));
    hin["conf_temperatures"] = Tensor::of<float>({block}, std::vector<float>(block, 1.f));
    hin["threshold"] = Tensor::of<float>({1}, {0.f});
    hin["sps"] = Tensor::of<float>({8}, sps);
    hin["budget"] = Tensor::of<int64_t>({1}, {0});
    hin["active"] = Tensor::of<uint8_t>({1}, {1});
    hin["mode"] = Tensor::of<int64_t>({1}, {0});
    hin["layout"] = Tensor::of<int64_t>({1}, {1});
    auto h = heads.run(hin);
    int64_t verifyLen = h["verify_len"].as<int64_t>()[0];
    std::vector<int64_t> tokens{anchor};
    for (int j = 0; j < verifyLen; ++j) tokens.push_back(h["draft_tokens"].as<int64_t>()[j]);
    auto v = verify(tokens, 0, verifyLen, &h["draft_probs"]);
    int64_t accepted = v["accepted"].as<int64_t>()[0];
    target.append(v["new_kv"], static_cast<int>(tokens.size()));
    target.length -= static_cast<int>(tokens.size()) - static_cast<int>(accepted) - 1;  // rollback: a length change
    for (int j = 0; j < accepted; ++j) committed.push_back(tokens[j + 1]);
    anchor = v["next_token"].as<int64_t>()[0];
    committed.push_back(anchor);
    ctx = v["taps"];
    ctxCount = accepted + 1;
    std::printf("round %d: verified %lld, accepted %lld\n", r, static_cast<long long>(verifyLen),
                static_cast<long long>(accepted));
  }
  std::printf("tokens:");
  for (auto t : committed) std::printf(" %lld", static_cast<long long>(t));
  std::printf("\n(tap width %d)\n", tapWidth);
  return 0;
}
