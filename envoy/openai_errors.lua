-- Ingress filter: gives error answers of the OpenAI-compatible API (/v1/...) OpenAI's shape,
--   {"error": {"message": ..., "type": ..., "param": null, "code": ...}}
-- keeping the HTTP status. A failed gRPC call reaches here already transcoded into
-- {"code": <gRPC code>, "message": ...} with the matching status; Envoy's own errors (no route,
-- no healthy upstream, body too large) are plain text. Successful answers pass untouched (their
-- bodies, streams included, are never buffered here).

local TYPES = {
  [400] = "invalid_request_error", [401] = "authentication_error", [403] = "permission_error",
  [404] = "not_found_error", [408] = "timeout_error", [413] = "invalid_request_error",
  [429] = "rate_limit_error", [499] = "cancelled", [500] = "server_error", [501] = "not_implemented",
  [502] = "server_error", [503] = "service_unavailable", [504] = "timeout_error",
}

local GRPC_CODES = {
  [1] = "cancelled", [2] = "unknown", [3] = "invalid_request", [4] = "deadline_exceeded",
  [5] = "model_not_found", [6] = "already_exists", [7] = "permission_denied",
  [8] = "rate_limit_exceeded", [9] = "failed_precondition", [10] = "aborted", [11] = "out_of_range",
  [12] = "unimplemented", [13] = "internal_error", [14] = "unavailable", [15] = "data_loss",
  [16] = "invalid_api_key",
}

-- The still-escaped text of the JSON string value of key in raw, or nil.
local function json_string(raw, key)
  local _, e = string.find(raw, '"' .. key .. '"%s*:%s*"')
  if not e then return nil end
  local out, i = {}, e + 1
  while i <= #raw do
    local c = string.sub(raw, i, i)
    if c == "\\" then
      out[#out + 1] = string.sub(raw, i, i + 1)
      i = i + 2
    elseif c == '"' then
      return table.concat(out)
    else
      out[#out + 1] = c
      i = i + 1
    end
  end
  return nil
end

local function escape(text)
  text = string.gsub(text, "\\", "\\\\")
  text = string.gsub(text, '"', '\\"')
  return (string.gsub(text, "%c", " "))
end

function envoy_on_request(handle)
  local path = handle:headers():get(":path") or ""
  if string.sub(path, 1, 4) == "/v1/" then
    local where = (handle:headers():get(":method") or "") .. " " .. path
    handle:streamInfo():dynamicMetadata():set("envoy.filters.http.lua", "openai", where)
  end
end

function envoy_on_response(handle)
  local meta = handle:streamInfo():dynamicMetadata():get("envoy.filters.http.lua")
  if meta == nil or meta["openai"] == nil then return end
  local status = tonumber(handle:headers():get(":status")) or 200
  if status < 400 then return end

  local body = handle:body()
  local raw = ""
  if body ~= nil and body:length() > 0 then raw = body:getBytes(0, body:length()) end
  local message = json_string(raw, "message")
  local grpc_code = tonumber(string.match(raw, '^%s*{%s*"code"%s*:%s*(%d+)'))
  if message == nil then
    local text = string.gsub(raw, "%s+$", "")
    if status == 404 then
      message = escape("no such endpoint: " .. meta["openai"])
    elseif status == 413 then
      message = "the request body is larger than the ingress accepts"
    elseif text ~= "" then
      message = escape(text)
    else
      message = "request failed with HTTP status " .. status
    end
  end
  local code = (grpc_code and GRPC_CODES[grpc_code]) or (status == 404 and "not_found") or "error"
  local kind = TYPES[status] or (status >= 500 and "server_error" or "invalid_request_error")
  local out = '{"error":{"message":"' .. message .. '","type":"' .. kind .. '","param":null,"code":"' .. code .. '"}}'
  if body ~= nil then
    body:setBytes(out)
  end
  handle:headers():replace("content-type", "application/json")
  handle:headers():replace("content-length", tostring(#out))
end
