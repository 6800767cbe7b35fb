// defines: nvfp4_weight_codes, fraction_changed (weight_codes.h)
#include "fourbit/rl/weight_codes.h"

#include "fourbit/tensor/error.h"

namespace fourbit::rl {

WeightCodes nvfp4_weight_codes(Model& model) {
  WeightCodes out;
  for (const LinearInfo& li : model.linears()) {
    const Prepared p = model.forward_weight(li.name);
    if (!p.is_quantized() || p.q.fmt != Format::NVFP4) continue;
    const Tensor h = p.q.codes.to(Device::CPU);
    out.packed[li.name] = std::vector<uint8_t>(h.data<uint8_t>(), h.data<uint8_t>() + h.numel());
    out.codes += p.q.total_rows() * p.q.cols;
  }
  return out;
}

double fraction_changed(const WeightCodes& before, const WeightCodes& after) {
  if (before.packed.size() != after.packed.size() || before.codes != after.codes)
    fail("weight codes: the snapshots are of different models");
  if (before.codes == 0) return 0.0;
  int64_t changed = 0;
  for (const auto& [name, a] : before.packed) {
    const auto it = after.packed.find(name);
    if (it == after.packed.end() || it->second.size() != a.size())
      fail("weight codes: {} differs in shape between the snapshots", name);
    // Two codes a byte; padding codes are zero in both, so they never count as changed.
    for (size_t i = 0; i < a.size(); ++i) {
      const uint8_t x = a[i] ^ it->second[i];
      changed += (x & 0x0F) != 0;
      changed += (x & 0xF0) != 0;
    }
  }
  return double(changed) / double(before.codes);
}

}  // namespace fourbit::rl
