// TensorRT IPluginV3 for dspark::ConfidenceTruncate (name "ConfidenceTruncate", version "1", namespace "dspark").
//
// It wraps the CUDA kernel of ../confidence_truncate.cu. The ONNX node carries no attributes: mode and layout are
// input tensors, so one engine serves every scheduling mode and a step never synchronises with the host.
// Inputs : survival [B,Bk] f32, threshold [B] f32, sps [N] f32, budget [1] i64, active [B] bool, mode [1] i64,
//          layout [1] i64.  Outputs: verify_len [B] i64, verify_mask [B,Bk] bool.
// Builds against TensorRT 10.x and 11.x (IPluginV3 is the plugin API of both).
#include <NvInfer.h>
#include <NvInferRuntime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "../confidence_truncate.h"

using namespace nvinfer1;

namespace dspark {
namespace {
constexpr char const* kNAME = "ConfidenceTruncate";
constexpr char const* kVERSION = "1";
constexpr char const* kNAMESPACE = "dspark";
constexpr int32_t kNB_INPUTS = 7;
constexpr int32_t kNB_OUTPUTS = 2;
}  // namespace

class ConfidenceTruncatePlugin final : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuild,
                                       public IPluginV3OneRuntime {
 public:
  ConfidenceTruncatePlugin() = default;

  // IPluginV3
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    switch (type) {
      case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
      case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
      case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }
  IPluginV3* clone() noexcept override { return new (std::nothrow) ConfidenceTruncatePlugin(); }

  // IPluginV3OneCore
  AsciiChar const* getPluginName() const noexcept override { return kNAME; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVERSION; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNAMESPACE; }

  // IPluginV3OneBuild
  int32_t getNbOutputs() const noexcept override { return kNB_OUTPUTS; }

  int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override {
    return (in != nullptr && out != nullptr && nbInputs == kNB_INPUTS && nbOutputs == kNB_OUTPUTS) ? 0 : -1;
  }

  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override {
    if (nbOutputs != kNB_OUTPUTS || nbInputs != kNB_INPUTS || inputTypes == nullptr) return -1;
    outputTypes[0] = DataType::kINT64;
    outputTypes[1] = DataType::kBOOL;
    return 0;
  }

  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                          int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& /*exprBuilder*/) noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS || inputs[0].nbDims != 2) return -1;
    outputs[0].nbDims = 1;
    outputs[0].d[0] = inputs[0].d[0];
    outputs[1] = inputs[0];
    return 0;
  }

  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS || pos < 0 || pos >= kNB_INPUTS + kNB_OUTPUTS) return false;
    static constexpr DataType kTYPES[kNB_INPUTS + kNB_OUTPUTS] = {
        DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT64, DataType::kBOOL,
        DataType::kINT64, DataType::kINT64, DataType::kINT64, DataType::kBOOL};
    auto const& desc = inOut[pos].desc;
    return desc.type == kTYPES[pos] && desc.format == TensorFormat::kLINEAR;
  }

  size_t getWorkspaceSize(DynamicPluginTensorDesc const*, int32_t, DynamicPluginTensorDesc const*,
                          int32_t) const noexcept override {
    return 0;
  }

  // IPluginV3OneRuntime
  int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS || in[0].dims.nbDims != 2) return -1;
    batch_ = static_cast<int32_t>(in[0].dims.d[0]);
    block_ = static_cast<int32_t>(in[0].dims.d[1]);
    sps_len_ = static_cast<int32_t>(in[2].dims.d[0]);
    return out != nullptr && dspark_confidence_truncate_smem(batch_, block_) <= 48 * 1024 ? 0 : -1;
  }

  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
                  void const* const* inputs, void* const* outputs, void* /*workspace*/,
                  cudaStream_t stream) noexcept override {
    int32_t const batch = static_cast<int32_t>(inputDesc[0].dims.d[0]);
    int32_t const block = static_cast<int32_t>(inputDesc[0].dims.d[1]);
    int32_t const sps_len = static_cast<int32_t>(inputDesc[2].dims.d[0]);
    return dspark_confidence_truncate(
        static_cast<float const*>(inputs[0]), static_cast<float const*>(inputs[1]),
        static_cast<float const*>(inputs[2]), sps_len, static_cast<int64_t const*>(inputs[3]),
        static_cast<uint8_t const*>(inputs[4]), static_cast<int64_t const*>(inputs[5]),
        static_cast<int64_t const*>(inputs[6]), batch, block, static_cast<int64_t*>(outputs[0]),
        static_cast<uint8_t*>(outputs[1]), stream);
  }

  IPluginV3* attachToContext(IPluginResourceContext* /*context*/) noexcept override { return clone(); }

  PluginFieldCollection const* getFieldsToSerialize() noexcept override {
    fields_.nbFields = 0;
    fields_.fields = nullptr;
    return &fields_;
  }

 private:
  int32_t batch_{0};
  int32_t block_{0};
  int32_t sps_len_{0};
  PluginFieldCollection fields_{};
};

class ConfidenceTruncateCreator final : public IPluginCreatorV3One {
 public:
  ConfidenceTruncateCreator() { fields_.nbFields = 0; fields_.fields = nullptr; }
  AsciiChar const* getPluginName() const noexcept override { return kNAME; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVERSION; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNAMESPACE; }
  PluginFieldCollection const* getFieldNames() noexcept override { return &fields_; }
  IPluginV3* createPlugin(AsciiChar const* /*name*/, PluginFieldCollection const* /*fc*/,
                          TensorRTPhase /*phase*/) noexcept override {
    return new (std::nothrow) ConfidenceTruncatePlugin();
  }

 private:
  PluginFieldCollection fields_{};
};

}  // namespace dspark

// Entry points TensorRT looks up in a plugin library (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins).
extern "C" {
void setLoggerFinder(nvinfer1::ILoggerFinder* /*finder*/) {}

nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static dspark::ConfidenceTruncateCreator creator;
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&creator};
  nbCreators = 1;
  return creators;
}
}
