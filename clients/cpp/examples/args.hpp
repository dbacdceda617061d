// A tiny "--name value" / "--flag" command-line reader for the example and the test driver.
#pragma once

#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ferrum_args {

class Args {
 public:
  Args(int argc, char** argv, int first = 1) {
    for (int i = first; i < argc; ++i) {
      std::string a = argv[i];
      if (a.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument " + a);
      if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) values_[a.substr(2)] = argv[++i];
      else values_[a.substr(2)] = "";
    }
  }
  bool has(const std::string& k) const { return values_.count(k) > 0; }
  std::string str(const std::string& k, const std::string& def = "") const {
    auto it = values_.find(k);
    return it == values_.end() ? def : it->second;
  }
  double num(const std::string& k, double def) const { return has(k) ? std::atof(str(k).c_str()) : def; }
  // "1,2,3" (or spaces) as token ids.
  std::vector<uint32_t> ids(const std::string& k) const {
    std::vector<uint32_t> out;
    std::string s = str(k);
    for (char& c : s)
      if (c == ',') c = ' ';
    std::istringstream in(s);
    for (unsigned long v; in >> v;) out.push_back(static_cast<uint32_t>(v));
    return out;
  }

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace ferrum_args
