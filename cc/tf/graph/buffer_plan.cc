#include "cc/tf/graph/buffer_plan.h"

#include <string>
#include <vector>

#include "cc/tf/runtime/runtime.h"
#include "tensorflow/core/common_runtime/optimization_registry.h"
#include "tensorflow/core/common_runtime/shape_refiner.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/graph/algorithm.h"

namespace tf_rdma {
namespace {

// On a consumer: per input port, the bytes that input carries when it comes from another task
// and its shape is static; -1 elsewhere.
constexpr char kInputBytesAttr[] = "_rdma_input_bytes";

bool CrossesTasks(const tensorflow::Edge& edge) {
  absl::StatusOr<std::string> from = TaskOfDevice(edge.src()->assigned_device_name());
  absl::StatusOr<std::string> to = TaskOfDevice(edge.dst()->assigned_device_name());
  return from.ok() && to.ok() && *from != *to;
}

class BufferPlanPass : public tensorflow::GraphOptimizationPass {
 public:
  tensorflow::Status Run(const tensorflow::GraphOptimizationPassOptions& options) override {
    if (Runtime::Get() == nullptr || options.graph == nullptr || *options.graph == nullptr) {
      return absl::OkStatus();
    }
    tensorflow::Graph& graph = **options.graph;
    std::vector<const tensorflow::Edge*> crossing;
    for (const tensorflow::Edge* edge : graph.edges()) {
      if (!edge->IsControlEdge() && CrossesTasks(*edge)) crossing.push_back(edge);
    }
    if (crossing.empty()) return absl::OkStatus();
    tensorflow::ShapeRefiner refiner(graph.versions(), graph.op_registry());
    refiner.set_require_shape_inference_fns(false);
    std::vector<tensorflow::Node*> order;
    tensorflow::GetReversePostOrder(graph, &order);
    // A node whose shapes cannot be inferred leaves its consumers unknown: only no plan for them.
    for (const tensorflow::Node* node : order) refiner.AddNode(node).IgnoreError();
    for (const tensorflow::Edge* edge : crossing) {
      tensorflow::shape_inference::InferenceContext* context = refiner.GetContext(edge->src());
      if (context == nullptr) continue;
      const tensorflow::shape_inference::ShapeHandle shape = context->output(edge->src_output());
      const tensorflow::DataType dtype = tensorflow::BaseType(edge->src()->output_type(edge->src_output()));
      if (!context->FullyDefined(shape) || !tensorflow::DataTypeCanUseMemcpy(dtype)) continue;
      tensorflow::Node* consumer = edge->dst();
      std::vector<int64_t> bytes;
      if (!tensorflow::TryGetNodeAttr(consumer->attrs(), kInputBytesAttr, &bytes)) {
        bytes.assign(consumer->num_inputs(), -1);
      }
      if (edge->dst_input() >= static_cast<int>(bytes.size())) continue;
      bytes[edge->dst_input()] = context->Value(context->NumElements(shape)) * tensorflow::DataTypeSize(dtype);
      consumer->AddAttr(kInputBytesAttr, bytes);
    }
    return absl::OkStatus();
  }
};

REGISTER_OPTIMIZATION(tensorflow::OptimizationPassRegistry::POST_REWRITE_FOR_EXEC, 100, BufferPlanPass);

}  // namespace

std::optional<int64_t> PlannedBytes(const tensorflow::Node& recv) {
  for (const tensorflow::Edge* edge : recv.out_edges()) {
    std::vector<int64_t> bytes;
    if (edge->IsControlEdge() || edge->src_output() != 0 ||
        !tensorflow::TryGetNodeAttr(edge->dst()->attrs(), kInputBytesAttr, &bytes) ||
        edge->dst_input() >= static_cast<int>(bytes.size()) || bytes[edge->dst_input()] < 0) {
      continue;
    }
    return bytes[edge->dst_input()];
  }
  return std::nullopt;
}

}  // namespace tf_rdma
