/**
 * Version 2's fail-mode list: the endpoint matcher against PROTOCOL.md's own table (read from the
 * page, so page and test cannot drift), and which checks touch a listed rule.
 */

import assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { describe, it } from "node:test";

import { closing, endpointMatches, touches, type Check, type ClosedRule, type FailModeList } from "../src/index";
import { REPO } from "./helpers";

describe("endpoint patterns", () => {
  it("match as PROTOCOL.md's table says, every row", () => {
    const doc = fs.readFileSync(path.join(REPO, "protocol", "PROTOCOL.md"), "utf8");
    let rows = 0;
    for (const line of doc.split("\n").filter((l) => l.startsWith("| `/"))) {
      const cells = line.split("|").map((c) => c.trim().replace(/^`|`$/g, ""));
      const [pattern, endpoint, want] = [cells[1], cells[2], cells[3] === "yes"];
      assert.equal(endpointMatches(pattern, endpoint), want, `${pattern} vs ${endpoint}`);
      rows++;
    }
    assert.equal(rows, 10, "the page's pattern table");
  });
});

describe("which checks touch a listed rule", () => {
  const login: ClosedRule = { ruleId: "login-per-ip", dimension: "ip", endpoint: "/login", tier: "", limit: 5 };
  const attrs = (a: Extract<Check, { form: "attributes" }>["attributes"]): Check => ({ form: "attributes", attributes: a });

  it("an items check touches a rule one of its items names", () => {
    const list: FailModeList = { rulesVersion: 0, truncated: false, rules: [login] };
    const named: Check = {
      form: "items",
      items: [
        { key: "a", ruleId: "api" },
        { key: "ip:1", ruleId: "login-per-ip" },
      ],
    };
    assert.equal(closing(list, named)?.limit, 5);
    assert.equal(closing(list, { form: "items", items: [{ key: "a", ruleId: "api" }] }), undefined);
  });

  it("an attribute check touches a rule the agent would match", () => {
    assert.ok(touches(login, attrs({ endpoint: "/login", ip: "203.0.113.5" })));
    assert.ok(!touches(login, attrs({ endpoint: "/login" })), "no IP: the rule would not apply");
    assert.ok(!touches(login, attrs({ endpoint: "/login", ip: "" })), "an empty IP is absent");
    assert.ok(!touches(login, attrs({ endpoint: "/search", ip: "203.0.113.5" })));
    assert.ok(!touches(login, attrs({ ip: "203.0.113.5" })), "no endpoint: a pattern cannot match");
    assert.ok(!touches(login, attrs({ endpoint: "/login", user: "u" })), "the rule's dimension is ip");

    const staff: ClosedRule = { ...login, dimension: "user", endpoint: "", tier: "staff" };
    assert.ok(touches(staff, attrs({ endpoint: "/x", user: "u", tier: "staff" })));
    assert.ok(touches(staff, attrs({ user: "u", tier: "staff" })), "an empty pattern: every endpoint, even none");
    assert.ok(!touches(staff, attrs({ endpoint: "/x", user: "u" })), "tier absent");
    assert.ok(!touches(staff, attrs({ endpoint: "/x", user: "u", tier: "free" })));

    const key: ClosedRule = { ...login, dimension: "apiKey", endpoint: "/api/*" };
    assert.ok(touches(key, attrs({ endpoint: "/api/a/b", apiKey: "k" })));
    assert.ok(!touches(key, attrs({ endpoint: "/api", apiKey: "k" })));

    const descriptor: ClosedRule = { ...login, dimension: "descriptor", endpoint: "" };
    assert.ok(!touches(descriptor, attrs({ endpoint: "/login", ip: "1", user: "u", apiKey: "k" })));
  });

  it("the first listed rule a check touches is the one that denies", () => {
    const wide: ClosedRule = { ruleId: "all-per-ip", dimension: "ip", endpoint: "", tier: "", limit: 1000 };
    const list: FailModeList = { rulesVersion: 1, truncated: false, rules: [wide, login] };
    assert.equal(closing(list, attrs({ endpoint: "/login", ip: "1" }))?.ruleId, "all-per-ip");
    assert.equal(closing({ ...list, rules: [login, wide] }, attrs({ endpoint: "/login", ip: "1" }))?.ruleId, "login-per-ip");
  });
});
