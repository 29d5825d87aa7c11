// Philox groups of TensorFlow's stateless random distributions (used by
// NestpipeStatelessRowInit for both keyings: fixed tables' rows, dynamic ids).
#ifndef TF_NESTPIPE_OPS_PHILOX_GROUP_SAMPLER_H_
#define TF_NESTPIPE_OPS_PHILOX_GROUP_SAMPLER_H_

#include <cstdint>
#include <string>

#include "tensorflow/core/lib/random/philox_random.h"
#include "tensorflow/core/lib/random/random_distributions.h"

namespace tensorflow {
namespace nestpipe {

using random::PhiloxRandom;

// Produces Philox group `g` of the chosen distribution, as TF's Fill tasks do.
class GroupSampler {
 public:
  GroupSampler(PhiloxRandom base, const std::string& dist) : base_(base) {
    if (dist == "uniform") kind_ = 0;
    else if (dist == "normal") kind_ = 1;
    else kind_ = 2;
  }

  const float* Group(int64_t g) {
    if (g == cached_) return values_;
    cached_ = g;
    PhiloxRandom gen = base_;
    if (kind_ == 0) {
      gen.Skip(g);
      auto s = random::UniformDistribution<PhiloxRandom, float>()(&gen);
      for (int i = 0; i < 4; ++i) values_[i] = s[i];
    } else if (kind_ == 1) {
      gen.Skip(g);
      auto s = random::NormalDistribution<PhiloxRandom, float>()(&gen);
      for (int i = 0; i < 4; ++i) values_[i] = s[i];
    } else {
      using Dist = random::TruncatedNormalDistribution<
          random::SingleSampleAdapter<PhiloxRandom>, float>;
      constexpr int64_t kSkipPerGroup = Dist::kResultElementCount * 256 /
                                        PhiloxRandom::kResultElementCount;
      gen.Skip(g * kSkipPerGroup);
      random::SingleSampleAdapter<PhiloxRandom> single(&gen);
      auto s = Dist()(&single);
      for (int i = 0; i < 4; ++i) values_[i] = s[i];
    }
    return values_;
  }

 private:
  PhiloxRandom base_;
  int kind_ = 0;
  int64_t cached_ = -1;
  float values_[4];
};

}  // namespace nestpipe
}  // namespace tensorflow

#endif  // TF_NESTPIPE_OPS_PHILOX_GROUP_SAMPLER_H_
