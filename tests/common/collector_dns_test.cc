#include "common/collector_dns.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope {
namespace {

using ::testing::ElementsAre;

TEST(ExpandCollectorName, KeepsWhatIsNotOneNameOfSeveralAddresses) {
  // A list is already the fleet; IP literals and gRPC URIs are one collector each.
  EXPECT_THAT(ExpandCollectorName({"a:1", "b:1"}), ElementsAre("a:1", "b:1"));
  EXPECT_THAT(ExpandCollectorName({"127.0.0.1:50051"}), ElementsAre("127.0.0.1:50051"));
  EXPECT_THAT(ExpandCollectorName({"[::1]:50051"}), ElementsAre("[::1]:50051"));
  EXPECT_THAT(ExpandCollectorName({"dns:///collector:50051"}),
              ElementsAre("dns:///collector:50051"));
  EXPECT_THAT(ExpandCollectorName({"unix:/run/rankscope.sock"}),
              ElementsAre("unix:/run/rankscope.sock"));
  EXPECT_THAT(ExpandCollectorName({"collector"}), ElementsAre("collector"));
  // One address per family at most (localhost: 127.0.0.1, maybe ::1): one collector, by name.
  EXPECT_THAT(ExpandCollectorName({"localhost:50051"}), ElementsAre("localhost:50051"));
}

}  // namespace
}  // namespace rankscope
