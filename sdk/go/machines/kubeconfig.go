package machines

// A small kubeconfig reader: the current context's server, CA, and credentials (a bearer
// token or token file, or a client certificate and key, inline or as files).
//
// client-go is not used: this module builds with the standard library alone, so that
// the Go toolchain Debian ships (1.19, with no module proxy reachable) builds and tests it.
// Kubeconfigs are YAML, which the standard library does not read, so a YAML subset is read
// here: block mappings and sequences, plain scalars (also over several lines) and quoted
// ones, comments, and `{}` / `[]` for empty values: what kubectl and `kruntimes up` write.
// Anything else (anchors, flow collections with content, block scalars, quoted scalars
// over several lines) is refused with an error that says so. A JSON kubeconfig is read as
// JSON.

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// maxKubeconfigBytes bounds the kubeconfig read.
const maxKubeconfigBytes = 4 << 20

// Kubeconfig is what the client takes from a kubeconfig's current context.
type Kubeconfig struct {
	// Server is the API server's URL.
	Server string
	// CAPEM is the API server's CA (PEM); empty: the system roots.
	CAPEM []byte
	// Token is the bearer token, if any.
	Token string
	// CertPEM and KeyPEM are the client certificate and key, if any.
	CertPEM, KeyPEM []byte
	// Namespace is the context's namespace ("default" when it names none).
	Namespace string
}

// LoadKubeconfig reads the kubeconfig at path; an empty path means $KUBECONFIG (its
// first entry), else ~/.kube/config.
func LoadKubeconfig(path string) (*Kubeconfig, error) {
	if path == "" {
		path = strings.Split(os.Getenv("KUBECONFIG"), string(os.PathListSeparator))[0]
	}
	if path == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return nil, fmt.Errorf("no kubeconfig: $KUBECONFIG is unset and there is no home directory: %w", err)
		}
		path = filepath.Join(home, ".kube", "config")
	}
	file, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read the kubeconfig: %w", err)
	}
	defer file.Close()
	data, err := io.ReadAll(io.LimitReader(file, maxKubeconfigBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read the kubeconfig %s: %w", path, err)
	}
	if len(data) > maxKubeconfigBytes {
		return nil, fmt.Errorf("the kubeconfig %s is over %d bytes", path, maxKubeconfigBytes)
	}
	doc, err := parseDocument(data)
	if err != nil {
		return nil, fmt.Errorf("the kubeconfig %s: %w", path, err)
	}
	return fromDocument(doc, filepath.Dir(path))
}

// parseDocument reads JSON (a document that starts with `{`) or the YAML subset.
func parseDocument(data []byte) (interface{}, error) {
	text := strings.TrimSpace(string(data))
	if strings.HasPrefix(text, "{") {
		var doc interface{}
		if err := json.Unmarshal(data, &doc); err != nil {
			return nil, fmt.Errorf("not valid JSON: %w", err)
		}
		return doc, nil
	}
	return parseYAML(string(data))
}

func fromDocument(doc interface{}, dir string) (*Kubeconfig, error) {
	root, ok := doc.(map[string]interface{})
	if !ok {
		return nil, fmt.Errorf("not a mapping at the top")
	}
	current := str(root["current-context"])
	if current == "" {
		return nil, fmt.Errorf("no current-context")
	}
	context := named(root["contexts"], current, "context")
	if context == nil {
		return nil, fmt.Errorf("no context %q", current)
	}
	cluster := named(root["clusters"], str(context["cluster"]), "cluster")
	if cluster == nil {
		return nil, fmt.Errorf("no cluster %q", str(context["cluster"]))
	}
	user := named(root["users"], str(context["user"]), "user")
	if user == nil {
		user = map[string]interface{}{}
	}
	config := &Kubeconfig{Server: str(cluster["server"]), Namespace: str(context["namespace"])}
	if config.Server == "" {
		return nil, fmt.Errorf("cluster %q has no server", str(context["cluster"]))
	}
	if config.Namespace == "" {
		config.Namespace = "default"
	}
	var err error
	if config.CAPEM, err = dataOrFile(cluster, "certificate-authority", dir); err != nil {
		return nil, err
	}
	if config.CertPEM, err = dataOrFile(user, "client-certificate", dir); err != nil {
		return nil, err
	}
	if config.KeyPEM, err = dataOrFile(user, "client-key", dir); err != nil {
		return nil, err
	}
	config.Token = str(user["token"])
	if file := str(user["tokenFile"]); config.Token == "" && file != "" {
		token, err := os.ReadFile(resolve(file, dir))
		if err != nil {
			return nil, fmt.Errorf("read the token file: %w", err)
		}
		config.Token = strings.TrimSpace(string(token))
	}
	if (user["exec"] != nil || user["auth-provider"] != nil) && config.Token == "" && config.CertPEM == nil {
		return nil, fmt.Errorf("user %q uses an exec or auth-provider plugin, which this client does not run", str(context["user"]))
	}
	return config, nil
}

// named returns entry[key] of the list entry whose name is name.
func named(list interface{}, name, key string) map[string]interface{} {
	items, _ := list.([]interface{})
	for _, item := range items {
		entry, _ := item.(map[string]interface{})
		if entry != nil && str(entry["name"]) == name {
			inner, _ := entry[key].(map[string]interface{})
			return inner
		}
	}
	return nil
}

// dataOrFile reads `<key>-data` (base64) or the file `<key>`.
func dataOrFile(m map[string]interface{}, key, dir string) ([]byte, error) {
	if data := str(m[key+"-data"]); data != "" {
		decoded, err := base64.StdEncoding.DecodeString(data)
		if err != nil {
			return nil, fmt.Errorf("%s-data is not base64: %w", key, err)
		}
		return decoded, nil
	}
	if file := str(m[key]); file != "" {
		data, err := os.ReadFile(resolve(file, dir))
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", key, err)
		}
		return data, nil
	}
	return nil, nil
}

func resolve(path, dir string) string {
	if filepath.IsAbs(path) {
		return path
	}
	return filepath.Join(dir, path)
}

func str(v interface{}) string {
	switch s := v.(type) {
	case string:
		return s
	case float64:
		return strconv.FormatFloat(s, 'f', -1, 64)
	case bool:
		return strconv.FormatBool(s)
	default:
		return ""
	}
}

// A YAML line: its indentation and its text.
type yamlLine struct {
	indent int
	text   string
	number int
}

// parseYAML reads the block-style YAML subset described above.
func parseYAML(text string) (interface{}, error) {
	var lines []yamlLine
	for i, raw := range strings.Split(text, "\n") {
		raw = strings.TrimRight(raw, " \t\r")
		trimmed := strings.TrimLeft(raw, " ")
		if trimmed == "" || strings.HasPrefix(trimmed, "#") || trimmed == "---" {
			continue
		}
		if strings.HasPrefix(trimmed, "\t") {
			return nil, fmt.Errorf("line %d: tabs do not indent YAML", i+1)
		}
		lines = append(lines, yamlLine{indent: len(raw) - len(trimmed), text: trimmed, number: i + 1})
	}
	if len(lines) == 0 {
		return map[string]interface{}{}, nil
	}
	p := &yamlParser{lines: lines}
	value, err := p.block(lines[0].indent)
	if err != nil {
		return nil, err
	}
	if p.at < len(p.lines) {
		return nil, fmt.Errorf("line %d: unexpected indentation", p.lines[p.at].number)
	}
	return value, nil
}

type yamlParser struct {
	lines []yamlLine
	at    int
}

func isItem(text string) bool {
	return text == "-" || strings.HasPrefix(text, "- ")
}

// block reads the mapping or sequence whose lines are at indent.
func (p *yamlParser) block(indent int) (interface{}, error) {
	if isItem(p.lines[p.at].text) {
		return p.sequence(indent)
	}
	return p.mapping(indent)
}

func (p *yamlParser) sequence(indent int) (interface{}, error) {
	items := []interface{}{}
	for p.at < len(p.lines) && p.lines[p.at].indent == indent && isItem(p.lines[p.at].text) {
		line := p.lines[p.at]
		rest := strings.TrimSpace(strings.TrimPrefix(line.text, "-"))
		if rest == "" {
			p.at++
			if p.at < len(p.lines) && p.lines[p.at].indent > indent {
				item, err := p.block(p.lines[p.at].indent)
				if err != nil {
					return nil, err
				}
				items = append(items, item)
			} else {
				items = append(items, nil)
			}
			continue
		}
		if _, _, isPair := splitPair(rest); isPair {
			// `- key: value` starts a mapping whose keys sit where `key` does.
			after := line.text[1:]
			inner := indent + 1 + len(after) - len(strings.TrimLeft(after, " "))
			p.lines[p.at] = yamlLine{indent: inner, text: rest, number: line.number}
			item, err := p.mapping(inner)
			if err != nil {
				return nil, err
			}
			items = append(items, item)
			continue
		}
		value, err := scalar(rest, line.number)
		if err != nil {
			return nil, err
		}
		items = append(items, value)
		p.at++
	}
	return items, nil
}

func (p *yamlParser) mapping(indent int) (interface{}, error) {
	m := map[string]interface{}{}
	for p.at < len(p.lines) && p.lines[p.at].indent == indent && !isItem(p.lines[p.at].text) {
		line := p.lines[p.at]
		key, rest, ok := splitPair(line.text)
		if !ok {
			return nil, fmt.Errorf("line %d: expected `key: value`", line.number)
		}
		key, err := scalarString(key, line.number)
		if err != nil {
			return nil, err
		}
		p.at++
		if rest != "" {
			// A plain scalar may go on over more-indented lines (kubectl folds long
			// strings with spaces this way): they are joined with single spaces.
			for !strings.HasPrefix(rest, "\"") && !strings.HasPrefix(rest, "'") &&
				p.at < len(p.lines) && p.lines[p.at].indent > indent {
				rest += " " + p.lines[p.at].text
				p.at++
			}
			value, err := scalar(rest, line.number)
			if err != nil {
				return nil, err
			}
			m[key] = value
			continue
		}
		switch {
		case p.at < len(p.lines) && p.lines[p.at].indent > indent:
			value, err := p.block(p.lines[p.at].indent)
			if err != nil {
				return nil, err
			}
			m[key] = value
		case p.at < len(p.lines) && p.lines[p.at].indent == indent && isItem(p.lines[p.at].text):
			// A sequence may sit at its key's own indentation.
			value, err := p.sequence(indent)
			if err != nil {
				return nil, err
			}
			m[key] = value
		default:
			m[key] = nil
		}
	}
	return m, nil
}

// splitPair splits `key: rest` (a quoted key may hold ": ").
func splitPair(text string) (string, string, bool) {
	start := 0
	if strings.HasPrefix(text, "\"") || strings.HasPrefix(text, "'") {
		quote := text[0]
		end := strings.IndexByte(text[1:], quote)
		if end < 0 {
			return "", "", false
		}
		start = end + 2
	}
	i := strings.Index(text[start:], ":")
	for i >= 0 {
		at := start + i
		if at+1 == len(text) || text[at+1] == ' ' {
			return strings.TrimSpace(text[:at]), strings.TrimSpace(text[at+1:]), true
		}
		next := strings.Index(text[at+1:], ":")
		if next < 0 {
			break
		}
		i = at + 1 + next - start
	}
	return "", "", false
}

// scalar reads a plain or quoted scalar, or an empty flow collection.
func scalar(text string, number int) (interface{}, error) {
	switch text {
	case "{}":
		return map[string]interface{}{}, nil
	case "[]":
		return []interface{}{}, nil
	case "null", "~":
		return nil, nil
	case "true":
		return true, nil
	case "false":
		return false, nil
	}
	return scalarString(text, number)
}

func scalarString(text string, number int) (string, error) {
	switch {
	case strings.HasPrefix(text, "\""):
		value, err := strconv.Unquote(text)
		if err != nil {
			return "", fmt.Errorf("line %d: a double-quoted scalar this reader cannot read: %w", number, err)
		}
		return value, nil
	case strings.HasPrefix(text, "'"):
		if len(text) < 2 || !strings.HasSuffix(text, "'") {
			return "", fmt.Errorf("line %d: an unterminated single-quoted scalar", number)
		}
		return strings.ReplaceAll(text[1:len(text)-1], "''", "'"), nil
	case strings.HasPrefix(text, "{"), strings.HasPrefix(text, "["), strings.HasPrefix(text, "&"),
		strings.HasPrefix(text, "*"), strings.HasPrefix(text, "|"), strings.HasPrefix(text, ">"):
		return "", fmt.Errorf("line %d: flow collections, anchors and block scalars are not read by this client", number)
	}
	if i := strings.Index(text, " #"); i >= 0 {
		text = strings.TrimSpace(text[:i])
	}
	return text, nil
}
